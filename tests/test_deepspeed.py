"""DeepSpeed ZeRO-3 for real, on CPU: 2 processes (gloo), sharded parameters, same weights as torch."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.learner.engine import EngineConfig, OptimConfig, TorchEngine

STEPS = 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero3_two_process_cpu_matches_single_process_torch(tiny_model_dir, tmp_path, monkeypatch):
    _torchrun("ds_zero3_worker.py", [tiny_model_dir, tmp_path, STEPS], tmp_path, monkeypatch)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    full = reports[0]["full"]
    for r in reports:
        assert r["world"] == 2 and abs(r["partition"] - full / 2) <= 0.02 * full  # each rank holds half
    assert reports[0]["losses"] == pytest.approx(reports[1]["losses"])  # all-reduced loss
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]

    # the same init, data and optimizer in one process with the torch engine
    from agentrl.learner.optim_state import reset_optimizer_state
    from tests.ds_zero3_worker import data, loss_fn

    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-3, grad_clip=1.0), token_budget=100_000))
    b = data(eng.pad_id)
    torch_losses = [eng.step(b, loss_fn)["loss"] for _ in range(STEPS)]
    reset_optimizer_state(eng)  # the exported weights below include a step from the zeroed state
    torch_losses.append(eng.step(b, loss_fn)["loss"])
    assert reports[0]["losses"] == pytest.approx(torch_losses, abs=1e-4)
    from agentrl.learner.models import load_model

    exported = load_model(tmp_path / "exported").state_dict()
    ref = eng.model.state_dict()
    worst = max((exported[k] - ref[k]).abs().max().item() for k in ref if k in exported)
    # Adam normalises each update: a float-order difference in a tiny gradient moves its weight by a fraction
    # of lr (1e-3), more on some CPUs than others (1.2e-4 measured on an AVX2-only one); a real mismatch
    # (a missed gather, another rank's rows) is lr or more on many weights
    assert worst < 5e-4, worst
    # a checkpoint's HF folder under DeepSpeed is bfloat16 by default (model.export_dtype=auto): the same
    # weights, rounded, and a config that says so
    import torch

    ckpt = load_model(tmp_path / "exported_ckpt", "bfloat16").state_dict()
    assert json.loads((tmp_path / "exported_ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(ckpt[k].dtype == torch.bfloat16 and torch.equal(ckpt[k], exported[k].to(torch.bfloat16))
               for k in exported if exported[k].is_floating_point())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_engine_after_close_in_one_process(tiny_model_dir):
    # close() destroys the process group; DeepSpeed's cached groups made from it must go with it, or the
    # next engine in this process (a sweep, a notebook) fails with "Group ... is not registered"
    code = (
        "import sys\n"
        "from agentrl.learner.deepspeed_engine import DeepSpeedEngine\n"
        "from agentrl.learner.engine import EngineConfig\n"
        "for i in range(2):\n"
        "    e = DeepSpeedEngine(sys.argv[1], EngineConfig(device='cpu'))\n"
        "    print('engine', i, e.rank, e.world, flush=True)\n"
        "    e.close()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True,
                         env=env, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine 0 0 1" in out.stdout and "engine 1 0 1" in out.stdout


def _torchrun(worker, args, tmp_path, monkeypatch, nproc=2, timeout=600):
    """``worker`` under torchrun on ``nproc`` CPU ranks (gloo); the finished process."""
    from torch.utils.cpp_extension import _get_build_directory

    from agentrl.launch import free_port

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the lock a process killed while DeepSpeed JIT-built its CPU shm op leaves behind: init must not wait on it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    (Path(_get_build_directory("deepspeed_shm_comm", False)) / "lock").touch()
    port = str(free_port())
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=root, OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    proc = subprocess.run([torchrun, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
                           os.path.join(root, "tests", worker), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_rows_are_dealt_by_tokens_and_the_stand_in_is_the_shortest_block():
    from agentrl.learner.batch import deal_rows, stand_in_rows

    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10]  # round-robin by index: 150 tokens to rank 0, 50 to rank 1
    dealt = deal_rows(lengths, 2)
    assert sorted(dealt[0] + dealt[1]) == list(range(10))
    assert [sum(lengths[i] for i in rows) for rows in dealt] == [100, 90]
    blocks = deal_rows([5, 5, 50, 50, 9, 9], 2, block=2)  # a block (a DPO pair) stays on one rank
    assert sorted(map(sorted, blocks)) == [[0, 1, 4, 5], [2, 3]]
    assert deal_rows([7], 3) == [[0], [], []]
    assert stand_in_rows([40, 3, 9, 3]) == [1]
    assert stand_in_rows([40, 41, 3, 60], block=2) == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero3_reference_critic_and_proximal_passes_run_each_rank_on_its_own_rows(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    # the KL reference (starpo*), the critic's values (ppo, starpo_ppo) and the staleness correction's
    # proximal pass: each rank runs only its rows, every rank gets the whole batch's numbers, and they are the
    # numbers of one process running the whole batch
    import torch

    from tests.ds_passes_worker import config, data, set_critic_head

    _torchrun("ds_passes_worker.py", [tiny_model_dir, tmp_path], tmp_path, monkeypatch)
    got = [torch.load(tmp_path / f"passes-rank{r}.pt", weights_only=True) for r in (0, 1)]
    eng = TorchEngine(tiny_model_dir, config())
    set_critic_head(eng.critic.head)
    eng.set_reference(tiny_model_dir)
    b = data(eng.pad_id)
    want = dict(ref=eng.ref_logprobs(b), prox=eng.logprobs(b), values=eng.logprobs(b, values=True)[1])
    assert want["values"].abs().sum() > 0
    real = b.attention_mask[:, 1:].bool()  # values past a row's end are padding's, whatever the batch's width
    assert sorted(got[0]["own"] + got[1]["own"]) == list(range(len(b)))
    for r in got:
        for name, t in want.items():
            diff = ((r[name] - t) * real).abs().max()
            assert diff < 1e-5, (name, diff)
            assert r["rows"][name] == len(r["own"]) < len(b), (name, r["rows"])  # its own rows, once
        # the reference sharded like the policy, in the training dtype
        assert r["ref_dtype"] == "torch.float32" and abs(r["ref_partition"] - r["ref_full"] / 2) <= 0.02 * r["ref_full"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_zero3_run_resumes_on_another_number_of_ranks(tiny_model_dir, tmp_path, monkeypatch):
    # saved on 2 ranks, resumed on 1 (DeepSpeed's universal checkpoint), saved, resumed on 2: the losses,
    # gradient norms and warm-up lrs of the uninterrupted 2-rank run
    files = lambda d: {p: p.read_bytes() for p in sorted((tmp_path / d).rglob("*")) if p.is_file()}  # noqa: E731
    saved = {}
    for phase, ranks in (("a", 2), ("b", 1), ("c", 2)):
        _torchrun("ds_resume_worker.py", [phase, tiny_model_dir, tmp_path], tmp_path, monkeypatch, nproc=ranks)
        saved[phase] = {**files("a"), **files("b")}
    # the checkpoint resumed from is read, never written (a's by b, b's by c)
    assert saved["a"] == {k: v for k, v in saved["b"].items() if "/a/" in str(k)}
    assert {k: v for k, v in saved["b"].items() if "/b/" in str(k)} == {k: v for k, v in saved["c"].items()
                                                                          if "/b/" in str(k)}
    got = {p: json.loads((tmp_path / f"{p}-rank0.json").read_text()) for p in "abc"}
    assert got["b"]["world"] == 1 and got["c"]["world"] == 2 and got["c"]["step"] == 5
    resumed = dict(got["b"]["losses"], **got["c"]["losses"])
    assert sorted(resumed) == ["3", "4", "5"]
    for step, want in got["a"]["losses"].items():
        assert resumed[step] == pytest.approx(want, rel=1e-5), step
    assert got["a"]["losses"]["3"][2] < got["a"]["losses"]["4"][2]  # the schedule's warm-up spans the resumes
    assert json.loads((tmp_path / "c-rank1.json").read_text())["losses"] == got["c"]["losses"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("universal-")) == []  # removed once loaded


def test_the_reference_is_sharded_and_offloaded_like_the_policy_without_optimizer_sections():
    from agentrl.learner.deepspeed_engine import load_ds_config, reference_ds_config

    root = Path(__file__).resolve().parent.parent
    policy = load_ds_config(root / "configs" / "deepspeed" / "zero3_offload.json")
    ref = reference_ds_config(policy)
    assert ref["zero_optimization"]["stage"] == 3 and ref["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "offload_optimizer" not in ref["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in ref
    assert ref["bf16"]["enabled"] is True and "offload_optimizer" in policy["zero_optimization"]  # a copy
    assert reference_ds_config(load_ds_config(None))["bf16"] == {"enabled": False}
