"""Run folders and checkpoints under faults: a folder the run did not write, corrupt or tampered checkpoints,
non-finite updates, torn files. Tiny model on the bandit (one pull per episode, seconds per run)."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from agentrl import checkpoint as ckpt
from agentrl.checkpoint import RunError
from agentrl.config_loader import load_config


def make(out: Path, model_dir: Path, *extra: str):
    import agentrl.recipes  # noqa: F401
    from agentrl.recipe import RECIPES
    from agentrl.trainer import Trainer

    cfg = load_config("grpo", env="bandit", overrides=overrides(out, model_dir, *extra))
    return Trainer(cfg, RECIPES.get(cfg.method)(cfg))


def overrides(out: Path, model_dir: Path, *extra: str) -> list[str]:
    """The tests' run (grpo on the bandit), as dotted overrides: ``agentrl train grpo --env bandit`` takes them too."""
    return [f"model.name={model_dir}", f"trainer.out_dir={out}", "trainer.steps=2", "sft.enabled=false", "eval.tasks=0",
            "trainer.progress=false", "trainer.tensorboard=false", "rollout.groups=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "trainer.checkpoint_every=1", "optim.lr=1e-3",
            # every step updates: no group is filtered out, and the entropy term gives a gradient even without reward
            "algo.filters=[dropped]", "algo.entropy_coef=0.01", *extra]


def train(out: Path, model_dir: Path, *extra: str) -> dict:
    t = make(out, model_dir, *extra)
    try:
        return t.train()
    finally:
        t.close()


def steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 2-step run checkpointed at steps 1 and 2 (trainer.keep_checkpoints=2)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(out, tiny_model_dir)
    return out


@pytest.fixture
def run(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, symlinks=True)
    return out


def resume(out: Path, model_dir: Path, *extra: str):
    """A trainer on ``out`` after its resume; returns (trainer, its step)."""
    t = make(out, model_dir, *extra)
    try:
        t.load_checkpoint()
        return t.step
    finally:
        t.close()


def reseal(folder: Path) -> None:
    """Rewrite a tampered checkpoint's manifest, as an attacker (or an old version) would."""
    m = ckpt.read_manifest(folder)
    ckpt.seal(folder, m["run_id"], m["step"])


# ----- the run folder ----------------------------------------------------------------------------------
def test_a_folder_that_is_not_a_run_folder_is_refused(tiny_model_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match=r"is not empty and is not an agentrl run folder \(no \.agentrl-run\).*--out"):
        make(tmp_path, tiny_model_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written


def test_a_second_run_in_a_folder_in_use_is_refused_naming_the_holder(tiny_model_dir, tmp_path):
    """Another process holds the folder (a live run): refused in one line naming its pid and host, nothing of
    the holder's touched; once it dies (the kernel drops its lock, as for a crashed run) the folder is usable."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from agentrl.checkpoint import lock_run_folder as lock; "
                               "f = lock(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=rf"is in use by another run \(pid {holder.pid} on .+\): wait for it"):
            make(out, tiny_model_dir)
        assert sorted(p.name for p in out.iterdir()) == [".agentrl-lock"]  # no marker, no config.yaml
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    t = make(out, tiny_model_dir)  # the holder is gone: its lock went with it
    t.close()


def test_a_run_folder_of_an_older_version_is_adopted(tmp_path):
    (tmp_path / "config.yaml").write_text("model:\n  name: tiny\ntrainer:\n  steps: 2\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    run_id = ckpt.claim_run_folder(tmp_path, {})
    assert json.loads((tmp_path / ".agentrl-run").read_text())["adopted"] is True
    assert ckpt.claim_run_folder(tmp_path, {}) == run_id  # the marker is read, not rewritten


def test_a_save_never_removes_what_the_run_did_not_write(tiny_model_dir, tmp_path):
    """Three saves with keep_checkpoints=2: the run's step-1 goes; the user's folders in checkpoints/ stay."""
    out = tmp_path / "run"
    ckpt.claim_run_folder(out, {})
    precious = out / "checkpoints" / "precious_model" / "weights.bin"
    precious.parent.mkdir(parents=True)
    precious.write_bytes(b"years of work")
    foreign = out / "checkpoints" / "step-000009"  # named like a checkpoint, but no manifest of this run's
    foreign.mkdir()
    (foreign / "engine.pt").write_bytes(b"someone else's")
    train(out, tiny_model_dir, "trainer.steps=3")
    assert precious.read_bytes() == b"years of work" and (foreign / "engine.pt").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["precious_model", "step-000002",
                                                                        "step-000003", "step-000009"]
    assert os.readlink(out / "checkpoint") == "checkpoints/step-000003"
    manifest = ckpt.read_manifest(out / "checkpoints" / "step-000003")
    assert {"trainer.pt", "engine.pt", "engine.json", "model/config.json"} <= set(manifest["files"])


# ----- corrupt checkpoints ----------------------------------------------------------------------------------
def test_flipped_bytes_fall_back_to_the_previous_checkpoint_and_say_so(run, tiny_model_dir, capsys):
    engine_pt = run / "checkpoints" / "step-000002" / "engine.pt"
    data = bytearray(engine_pt.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    engine_pt.write_bytes(bytes(data))
    assert resume(run, tiny_model_dir) == 1
    out = capsys.readouterr().out
    assert ("checkpoint step-000002 is corrupt (engine.pt fails its sha256 checksum; kept as "
            "checkpoints/corrupt-step-000002): resumed from step-000001 (step 1) instead") in out
    assert os.readlink(run / "checkpoint") == "checkpoints/step-000001"
    assert (run / "checkpoints" / "corrupt-step-000002" / "engine.pt").exists()  # renamed, not deleted


@pytest.mark.parametrize("name", ["trainer.pt", "engine.pt"])
def test_a_truncated_file_falls_back(run, tiny_model_dir, capsys, name):
    f = run / "checkpoints" / "step-000002" / name
    f.write_bytes(f.read_bytes()[:100])
    assert resume(run, tiny_model_dir) == 1
    assert f"{name} is truncated or altered (100 bytes" in capsys.readouterr().out


def test_no_intact_checkpoint_is_one_error_and_nothing_changes(run, tiny_model_dir):
    for s in ("step-000001", "step-000002"):
        f = run / "checkpoints" / s / "engine.pt"
        f.write_bytes(f.read_bytes()[:-10])
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(RunError, match=r"^no intact checkpoint to resume in .*step-000002: engine.pt is truncated.*"
                                       r"step-000001: engine.pt is truncated.*Nothing was changed or deleted"):
        resume(run, tiny_model_dir)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def test_no_intact_checkpoint_is_refused_before_the_run_folder_is_written(run, tiny_model_dir):
    """The error says nothing was changed: it used to come after config.yaml was rewritten (here with new budgets)
    and a tb/ event file made. The checkpoints are verified before either."""
    for s in ("step-000001", "step-000002"):
        f = run / "checkpoints" / s / "engine.pt"
        f.write_bytes(f.read_bytes()[:-10])
    config, stamp = (run / "config.yaml").read_bytes(), (run / "config.yaml").stat().st_mtime_ns
    with pytest.raises(RunError, match="step-000001: engine.pt is truncated.*Nothing was changed or deleted"):
        make(run, tiny_model_dir, "trainer.tensorboard=true", "trainer.steps=3")
    assert (run / "config.yaml").read_bytes() == config and (run / "config.yaml").stat().st_mtime_ns == stamp
    assert not (run / "tb").exists()


def test_a_destroyed_checkpoint_behind_the_link_falls_back(run, tiny_model_dir, capsys):
    shutil.rmtree(run / "checkpoints" / "step-000002")
    assert resume(run, tiny_model_dir) == 1
    assert "checkpoint pointed to step-000002, which is missing: resumed from step-000001" in capsys.readouterr().out
    assert os.readlink(run / "checkpoint") == "checkpoints/step-000001"


def test_a_dangling_link_with_nothing_else_is_an_error_not_a_fresh_start(run, tiny_model_dir):
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(RunError, match=r"points to step-000002, which is missing, and .* holds no other complete"):
        train(run, tiny_model_dir, "trainer.steps=3")
    assert steps(run) == [0, 1, 2]  # no fresh start: the metrics were not truncated


class _Payload:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_that_would_run_code_is_refused(run, tiny_model_dir, tmp_path, capsys):
    pwned = tmp_path / "pwned"
    folder = run / "checkpoints" / "step-000002"
    state = ckpt.load_plain(folder / "trainer.pt")
    state["recipe"] = _Payload(pwned)
    torch.save(state, folder / "trainer.pt")
    reseal(folder)  # checksums valid: only weights_only stands between the file and the code
    with pytest.raises(ckpt.CheckpointCorrupt, match=r"holds Python objects other than tensors.*(posix|os)\.system"):
        ckpt.load_plain(folder / "trainer.pt")
    assert resume(run, tiny_model_dir) == 1
    assert "trainer.pt holds Python objects other than tensors and containers" in capsys.readouterr().out
    assert not pwned.exists()


def test_nan_weights_with_valid_checksums_are_refused(run, tiny_model_dir, capsys):
    folder = run / "checkpoints" / "step-000002"
    state = ckpt.load_plain(folder / "engine.pt")
    name = next(iter(state["model"]))
    state["model"][name][0] = float("nan")
    torch.save(state, folder / "engine.pt")
    reseal(folder)  # an old version saved NaN weights and sealed them
    assert resume(run, tiny_model_dir) == 1
    assert "its weights hold non-finite values" in capsys.readouterr().out


# ----- non-finite updates ---------------------------------------------------------------------------------
def nan_loss(trainer) -> None:
    """Make the recipe's loss NaN (as a NaN reward or log-prob would)."""
    recipe = trainer.recipe
    real = recipe.loss_fn

    def loss_fn(tr):
        fn = real(tr)

        def nan(mb, out):
            loss, stats = fn(mb, out)
            return loss * float("nan"), stats
        return nan
    recipe.loss_fn = loss_fn


def test_nan_loss_stops_the_run_naming_the_step_and_saves_nothing(tiny_model_dir, tmp_path):
    t = make(tmp_path, tiny_model_dir)
    before = [p.detach().clone() for p in t.engine.trainable_parameters()]
    nan_loss(t)
    try:
        with pytest.raises(RunError, match=r"^step 1: non-finite loss nan.*trainer.nan_policy=stop.*neither applied "
                                           r"nor saved"):
            t.train()
        assert all(torch.equal(a, b) for a, b in zip(before, t.engine.trainable_parameters()))
    finally:
        t.close()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "final.json").exists()


def test_nan_skip_policy_drops_and_counts_the_updates(tiny_model_dir, tmp_path):
    t = make(tmp_path, tiny_model_dir, "trainer.nan_policy=skip", "trainer.steps=1")
    before = [p.detach().clone() for p in t.engine.trainable_parameters()]
    nan_loss(t)
    try:
        t.train()
        assert all(torch.equal(a, b) for a, b in zip(before, t.engine.trainable_parameters()))
    finally:
        t.close()
    row = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["step"] == 1 and row["nonfinite_skipped"] > 0 and row["optim_steps"] == 0
    assert ckpt.verify(tmp_path / "checkpoints" / "step-000001") is None  # the finite weights were saved


def test_nan_weights_after_an_update_stop_the_run(tiny_model_dir, tmp_path):
    t = make(tmp_path, tiny_model_dir, "trainer.nan_policy=skip")  # an update that was applied cannot be skipped
    real = t.engine.step

    def step(*a, **k):
        s = real(*a, **k)
        with torch.no_grad():
            t.engine.trainable_parameters()[0].view(-1)[0] = float("inf")
        return s
    t.engine.step = step
    try:
        with pytest.raises(RunError, match=r"^step 1: the weights hold non-finite values after this update"):
            t.train()
    finally:
        t.close()
    assert not (tmp_path / "checkpoints").exists()


# ----- torn files ------------------------------------------------------------------------------------------
def test_a_torn_final_json_does_not_break_the_rerun(run, tiny_model_dir):
    (run / "final.json").write_text('{"eval/succ')  # an older version killed while writing it
    train(run, tiny_model_dir)  # the finished run started again
    assert json.loads((run / "final.json").read_text()) == {}
    ckpt_tmp = [p.name for p in run.iterdir() if ".tmp" in p.name]
    assert not ckpt_tmp


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(run, tiny_model_dir):
    """Files capped below a checkpoint's (``ulimit -f``; SIGXFSZ ignored, so a write fails instead of killing):
    the save of step 3 fails. It was a 28-line traceback ending in torch's ``RuntimeError ... unexpected pos``
    and left the partial ``step-000003`` behind."""
    import resource
    import signal
    import subprocess
    import sys

    cap = (run / "checkpoints" / "step-000002" / "engine.pt").stat().st_size // 2

    def limit_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # kept across exec: the write raises EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "grpo", "--env", "bandit",
                          *overrides(run, tiny_model_dir, "trainer.steps=3")], preexec_fn=limit_files,
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=240)
    errors = [x for x in out.stderr.splitlines() if x.startswith("error")]
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint {run / 'checkpoints' / 'step-000003'} could not be written ("), \
        errors[0]
    assert "and was removed: a checkpoint needs about" in errors[0], errors[0]
    assert f"capped at {cap / 2**20:.1f} MiB" in errors[0], errors[0]
    assert ckpt.step_folders(run / "checkpoints") == [run / "checkpoints" / f"step-00000{k}" for k in (2, 1)]
    assert os.readlink(run / "checkpoint") == "checkpoints/step-000002" and ckpt.verify(run / "checkpoint") is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_says_where_the_run_stopped_and_how_to_resume(tiny_model_dir, tmp_path):
    """SIGTERM ended a run in 0.07 s with exit code 143 and no word: it still does, and says at which step it
    stopped, the checkpoint it resumes from, and how."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", "grpo", "--env", "bandit",
                             *overrides(out, tiny_model_dir, "trainer.steps=200", "trainer.checkpoint_every=2")],
                            cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200
        while not ((out / "metrics.jsonl").is_file() and steps(out)[-1:] >= [3]) and proc.poll() is None:
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.2)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode in (143, -signal.SIGTERM) and took < 5, err[-3000:]  # killed by it, or exit 128 + 15
    target, missing = ckpt.link_target(out)
    assert not missing and ckpt.verify(target) is None
    assert lines[-1].startswith("stopped by SIGTERM in step ") and f" of {out} " in lines[-1]
    assert lines[-1].endswith(f"(the last checkpoint is {target.name}): run the same command to resume")


def test_the_sigterm_message_is_undone_after_the_run(tmp_path):
    """In-process callers of ``agentrl train`` (tests, notebooks) get their SIGTERM handling back."""
    import signal
    from types import SimpleNamespace

    from agentrl.commands.train import _say_where_sigterm_stops

    before, fd = signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    undo = _say_where_sigterm_stops(SimpleNamespace(is_main=True, out_dir=tmp_path, step=0))
    assert signal.getsignal(signal.SIGTERM) is not before
    undo()
    assert signal.getsignal(signal.SIGTERM) is before and signal.set_wakeup_fd(fd) == fd


def test_a_failed_write_of_torch_or_safetensors_is_the_save_error(tmp_path):
    """How each writer reports a write past a file size limit (torch: a RuntimeError "unexpected pos";
    safetensors: an "I/O error") is recognised as a failed write; any other error is raised as it is."""
    import resource
    import signal

    from safetensors.torch import save_file

    folder = tmp_path / "checkpoints" / "step-000001"
    folder.mkdir(parents=True)
    big = torch.zeros(2**18)  # 1 MiB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    caught = []
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, hard))  # this process's own files only, until restored
        for write in (lambda: torch.save({"x": big}, folder / "engine.pt"),
                      lambda: save_file({"x": big}, folder / "model.safetensors")):
            with pytest.raises(ckpt.WRITE_ERRORS) as e:
                write()
            caught.append(e.value)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert isinstance(caught[0], RuntimeError) and "unexpected pos" in str(caught[0])  # torch's words for it
    last = tmp_path / "checkpoint"
    for e in caught:
        err = ckpt.write_failed(e, folder, last, remove=False)
        assert str(err).startswith(f"checkpoint {folder} could not be written (") and "\n" not in str(err)
        assert "there is no complete one yet" in str(err)
    with pytest.raises(RuntimeError, match="^a bug$"):
        ckpt.write_failed(RuntimeError("a bug"), folder, last, remove=True)
    ckpt.write_failed(caught[0], folder, last, remove=True)
    assert not folder.exists()


def test_a_kill_before_the_first_checkpoint_leaves_no_duplicate_step_0(tiny_model_dir, tmp_path):
    train(tmp_path, tiny_model_dir, "trainer.steps=0")  # step 0 logged, no checkpoint: as if killed in step 1
    assert steps(tmp_path) == [0] and not (tmp_path / "checkpoint").exists()
    train(tmp_path, tiny_model_dir, "trainer.steps=0")
    assert steps(tmp_path) == [0]


def test_plain_state_round_trips_agentrl_dataclasses_only():
    from agentrl.learner.batch import Sample

    s = Sample([1, 2], [0, 1], [0.0, -1.0], [0.5, 0.5], meta={"k": (1, 2)})
    plain = ckpt.to_plain({"sil": [s], "keys": {("a", 1): 0.5}, "seen": {3, 4}})
    assert ckpt.from_plain(plain) == {"sil": [s], "keys": {("a", 1): 0.5}, "seen": {3, 4}}
    with pytest.raises(ckpt.CheckpointCorrupt, match="outside agentrl"):
        ckpt.from_plain({"__dataclass__": "subprocess:Popen", "fields": {"args": "true"}})
    with pytest.raises(TypeError, match=r"recipe\[0\]: a object cannot be stored"):
        ckpt.to_plain([object()], "recipe")


_DS_SCRIPT = """
import glob, os, sys, torch
from agentrl import checkpoint as ckpt
from agentrl.algos.losses import Objective, ppo_objective
from agentrl.config import AlgoCfg
from agentrl.learner.batch import Sample, collate
from agentrl.learner.deepspeed_engine import DeepSpeedEngine
from agentrl.learner.engine import EngineConfig, OptimConfig

model, folder, pwned = sys.argv[1:4]
cfg = EngineConfig(device="cpu", optim=OptimConfig(lr=1e-3))
b = collate([Sample([1, 2, 3, 4], [0, 0, 1, 1], [-1.0] * 4, [1.0] * 4) for _ in range(2)], 0)
loss = lambda mb, out: ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask, Objective.of(AlgoCfg()))
e = DeepSpeedEngine(model, cfg)
e.step(b, loss)
e.save(folder)
ref = e.step(b, loss)["loss"]
e.close()
e = DeepSpeedEngine(model, cfg)
e.load(folder)
print("same next loss", e.step(b, loss)["loss"] == ref, flush=True)

class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {pwned}",))

shard = glob.glob(os.path.join(folder, "deepspeed", "*", "*optim_states.pt"))[0]
state = torch.load(shard, weights_only=False)  # the test's own file
state["extra"] = Payload()
torch.save(state, shard)
try:
    e.load(folder)
    print("loaded the tampered shard", flush=True)
except ckpt.CheckpointCorrupt as err:
    print("refused:", err, flush=True)
e.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_checkpoints_resume_exactly_and_refuse_a_tampered_shard(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", _DS_SCRIPT, str(tiny_model_dir), str(tmp_path / "ck"),
                          str(tmp_path / "pwned")], capture_output=True, text=True, env=env, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "same next loss True" in out.stdout
    assert "refused: zero_pp_rank_0_mp_rank_00_optim_states.pt holds Python objects other than tensors" in out.stdout
    assert not (tmp_path / "pwned").exists()
