"""`agentrl train ... --dry-run`: the launch plan of the layouts docs/guides/gpu.md gives, and one error line
for each layout that cannot work. Only the model folder's config.json is read."""
import json

import pytest

from agentrl.commands.plan import build
from agentrl.config_loader import load_config

QWEN7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
DS = ["trainer.engine=deepspeed", "trainer.deepspeed_config=configs/deepspeed/zero3.json", "trainer.generator=vllm",
      "rollout.groups=16"]  # each of up to 12 learner ranks rolls out whole groups


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen7b")
    (folder / "config.json").write_text(json.dumps(QWEN7B))  # no weights: the plan must not need them
    return str(folder)


def plan(model, overrides, nodes=1, gpus=8, gib=74.5):
    return build(load_config("grpo", model=model, overrides=overrides), nodes, gpus, gib)


def test_one_node_six_learner_ranks_and_two_servers(qwen7b):
    out, errors = plan(qwen7b, DS + ["trainer.vllm_servers=2", "trainer.vllm_gpus=[6,7]", "optim.token_budget=6144",
                                     "vllm.max_model_len=8192", "vllm.max_num_seqs=128"])
    assert errors == []
    text = "\n".join(out)
    assert [f"  GPU {g}: learner rank {g}" for g in range(6)] == out[2:8]
    assert out[8:10] == ["  GPU 6: vLLM server 0", "  GPU 7: vLLM server 1"]
    server0 = next(x for x in out if x.startswith("vLLM server 0 "))
    assert "CUDA_VISIBLE_DEVICES=6 " in server0 and "--port 8100" in server0 and f"--model {qwen7b}" in server0
    assert "--max-model-len 8192" in server0 and "--max-num-seqs 128" in server0
    assert "--weight-transfer-config '{\"backend\": \"nccl\"}'" in server0
    assert "learner: world 6, rendezvous 127.0.0.1:29500" in text
    assert "weight transfer: world 3 (rank 0 + 2 server worker(s)" in text and "127.0.0.1:29700" in text
    assert "model states 18.9 GiB" in text  # 16 x 7.62e9 / 6 ranks
    assert "without checkpointing" in text and " with (model.gradient_checkpointing=false)" in text


def test_two_nodes_with_tensor_parallel_servers(qwen7b):
    out, errors = plan(qwen7b, DS + ["trainer.vllm_servers=2", "trainer.vllm_gpus=['4,5','6,7']",
                                     "vllm.tensor_parallel_size=2", "vllm.host=0.0.0.0", "optim.token_budget=6144"],
                       nodes=2)
    assert errors == []
    text = "\n".join(out)
    assert "learner: 12 rank(s)" in out[0]
    assert out.index("node 1:") and "  GPU 7: learner rank 11" in out
    assert "  GPU 4: vLLM server 0" in out and "  GPU 7: vLLM server 1" in out  # node 0's
    server1 = next(x for x in out if x.startswith("vLLM server 1 "))
    assert "CUDA_VISIBLE_DEVICES=6,7 " in server1 and "--tensor-parallel-size 2" in server1
    assert "--host 0.0.0.0" in server1
    assert "learner: world 12, rendezvous MASTER_ADDR" in text
    assert "weight transfer: world 5 (rank 0 + 4 server worker(s)" in text and ":29700" in text
    assert "127.0.0.1" not in text  # nothing on loopback across nodes
    assert "(28,672 bytes a token)" in text  # KV heads split over TP=2


def test_colocated_on_one_gpu(tmp_path):
    out, errors = plan("tiny", ["trainer.generator=vllm", "vllm.colocate=true", "vllm.gpu_memory_utilization=0.3"],
                       gpus=1, gib=22)
    assert errors == [], errors
    assert out[2] == "  GPU 0: learner rank 0 + vLLM server 0"
    server = next(x for x in out if x.startswith("vLLM server 0 "))
    assert "--enable-sleep-mode" in server and "--gpu-memory-utilization 0.3" in server
    assert "'{\"backend\": \"ipc\"}'" in server
    assert any("CUDA IPC" in x for x in out)
    assert "of 10.9 GiB usable" in "\n".join(out)  # 22 x (1 - 0.3) - 4.5


@pytest.mark.parametrize("overrides,nodes,error", [
    (["trainer.vllm_servers=1"], 1,
     "vLLM server 0 has no GPU of its own (trainer.vllm_gpus has 0 entries for trainer.vllm_servers=1) and would "
     "share learner GPU 0: list its GPUs in trainer.vllm_gpus or set vllm.colocate=true"),
    (["trainer.vllm_servers=1", "trainer.vllm_gpus=[7]", "vllm.tensor_parallel_size=2"], 1,
     "vLLM server 0 has 1 GPU(s) (7) but vllm.tensor_parallel_size=2: give each server exactly 2 in "
     "trainer.vllm_gpus"),
    (["trainer.vllm_servers=1", "trainer.vllm_gpus=[8]"], 1,
     "vLLM server 0 names GPU 8, but a node has GPUs 0-7"),
    (["trainer.vllm_servers=1", "trainer.vllm_gpus=[7]", "vllm.gpu_memory_utilization=0.15"], 1,
     "a vLLM server's weights (14.2 GiB a GPU) do not fit its share 11.2 GiB (vllm.gpu_memory_utilization=0.15): "
     "raise it, or vllm.tensor_parallel_size"),
    (["trainer.vllm_servers=1", "trainer.vllm_gpus=[7]"], 2,
     "ranks on nodes 1-1 cannot reach servers bound to vllm.host=127.0.0.1: set vllm.host=0.0.0.0 (and "
     "vllm.advertise_host to node 0's address if its hostname does not resolve to it)"),
    (["vllm.colocate=true", "trainer.vllm_servers=1"], 1,
     "vllm.colocate=true needs vllm.gpu_memory_utilization, the share of each GPU a server takes (e.g. 0.3), "
     "below 1: the rest is the learner's"),
])  # vllm.colocate=true with trainer.vllm_sync=nccl: refused when the config loads (tests/test_refusals.py)
def test_a_layout_that_cannot_work_is_one_error_line(qwen7b, overrides, nodes, error):
    _, errors = plan(qwen7b, DS + ["optim.token_budget=4096"] + overrides, nodes=nodes)
    assert error in errors, errors


def test_a_learner_over_its_gpu_names_the_budget_and_the_ranks_that_fit(qwen7b):
    # 7B at the paper's micro-batch on 4 ZeRO-3 ranks: 154 GiB a rank (the guide's row); 49 with checkpointing
    _, errors = plan(qwen7b, DS + ["trainer.vllm_servers=1", "trainer.vllm_gpus=[4]", "optim.token_budget=20480"],
                     gpus=5)
    assert errors == ["a learner rank needs 153.7 GiB but has 70.0 GiB of its GPU (4 rank(s), ZeRO stage 3): use "
                      "optim.token_budget=6678 or model.gradient_checkpointing=true"]
    # one rank of the torch engine (16 psi = 113 GiB): no budget, no ranks under stage 0 help
    _, errors = plan(qwen7b, ["trainer.generator=embedded"], gpus=1)
    assert errors == ["a learner rank needs " + errors[0].split("needs ", 1)[1]]
    assert "a larger GPU, or configs/deepspeed/zero3_offload.json" in errors[0]


def test_the_cli_prints_the_plan_and_exits_without_a_gpu(qwen7b, capsys):
    from agentrl.cli import main

    rc = main(["train", "grpo", "--model", qwen7b, "--dry-run", "--nodes", "1", "--gpus-per-node", "8", *DS,
               "trainer.vllm_servers=2", "trainer.vllm_gpus=[6,7]", "optim.token_budget=6144", "rollout.groups=8"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("launch plan: 1 node(s) x 8 GPU(s) of 74.5 GiB") and "error:" not in out
    rc = main(["train", "grpo", "--model", qwen7b, "--dry-run", "--gpus-per-node", "8", *DS, "trainer.vllm_servers=2",
               "optim.token_budget=6144", "rollout.groups=8"])
    out = capsys.readouterr().out
    assert rc == 2 and [x for x in out.splitlines() if x.startswith("error: ")] == [
        "error: vLLM server 0 has no GPU of its own (trainer.vllm_gpus has 0 entries for trainer.vllm_servers=2) "
        "and would share learner GPU 0: list its GPUs in trainer.vllm_gpus or set vllm.colocate=true",
        "error: vLLM server 1 has no GPU of its own (trainer.vllm_gpus has 0 entries for trainer.vllm_servers=2) "
        "and would share learner GPU 0: list its GPUs in trainer.vllm_gpus or set vllm.colocate=true"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the default shape on a machine without GPUs")
def test_without_gpus_here_the_plan_asks_for_the_nodes_shape(qwen7b, capsys):
    from agentrl.cli import main

    assert main(["train", "grpo", "--model", qwen7b, "--dry-run", *DS]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        "error: --nodes 1 --gpus-per-node 0: a plan needs at least one GPU (this machine has none visible: give "
        "the nodes' shape, e.g. --nodes 1 --gpus-per-node 8)"]


def _learner_line(out):
    return next(x for x in out if x.startswith("  learner rank:"))


SIX = DS + ["trainer.vllm_servers=2", "trainer.vllm_gpus=[6,7]", "optim.token_budget=8192"]


@pytest.mark.parametrize("recipe", ["ppo", "starpo_ppo", "starpo_s"])
def test_a_separate_critic_is_charged_its_states_and_activations(qwen7b, recipe):
    out, errors = build(load_config(recipe, model=qwen7b, overrides=SIX), 1, 8, 74.5)
    line = _learner_line(out)
    # 16 bytes a parameter of the transformer without its untied LM head, over 6 ranks; the critic's forward is
    # kept for the backward beside the policy's: twice the activations
    assert "+ critic 17.6 GiB +" in line and "90.1 GiB without checkpointing" in line
    assert errors and errors[0].startswith("a learner rank needs 13")  # ~130 GiB: it does not fit at 8192


def test_the_reference_is_its_bf16_shards_2_bytes_over_n(qwen7b):
    out, errors = build(load_config("starpo", model=qwen7b, overrides=SIX), 1, 8, 74.5)
    assert "reference 2.4 GiB" in _learner_line(out)  # 2 x 7.62e9 / 6
    # 72.1 GiB at 8192 tokens: a smaller budget, more ranks, checkpointing or a vocabulary chunk fits
    assert errors == ["a learner rank needs 72.1 GiB but has 70.0 GiB of its GPU (6 rank(s), ZeRO stage 3): use "
                      "optim.token_budget=7847 or 8 learner ranks or model.gradient_checkpointing=true or "
                      "optim.logits_chunk=512"]
    out, errors = build(load_config("starpo", model=qwen7b, overrides=SIX + ["optim.logits_chunk=512"]), 1, 8, 74.5)
    assert ("+ logits of one 512-position chunk of 1638 generated (optim.logits_chunk=512) 1.5 GiB = 68.9 GiB"
            in _learner_line(out)) and errors == []
    # the default DeepSpeed config has no bf16: fp32 shards, 4 bytes over N
    fp32 = [x for x in SIX if not x.startswith("trainer.deepspeed_config")]
    out, _ = build(load_config("starpo", model=qwen7b, overrides=fp32), 1, 8, 74.5)
    assert "ZeRO-3 in fp32" in out[0] and "reference 4.7 GiB" in _learner_line(out)


def test_the_embedded_generators_copy_under_deepspeed(qwen7b):
    over = ["trainer.engine=deepspeed", "trainer.deepspeed_config=configs/deepspeed/zero3.json", "rollout.groups=16",
            "optim.token_budget=4096"]
    out, _ = build(load_config("grpo", model=qwen7b, overrides=over), 1, 8, 74.5)
    assert "+ generator copy 28.4 GiB +" in _learner_line(out)  # a whole copy per rank in model.dtype (fp32)
    out, _ = build(load_config("grpo", model=qwen7b, overrides=over + ["model.dtype=bfloat16"]), 1, 8, 74.5)
    assert "+ generator copy 14.2 GiB +" in _learner_line(out)
    out, _ = build(load_config("grpo", model=qwen7b, overrides=SIX), 1, 8, 74.5)
    assert "generator copy" not in _learner_line(out)  # vLLM servers: no copy on the learner


def test_a_row_longer_than_the_budget_is_a_micro_batch_of_its_own(qwen7b, tmp_path):
    six = DS + ["trainer.vllm_servers=2", "trainer.vllm_gpus=[6,7]", "optim.token_budget=6144"]
    out, _ = build(load_config("grpo", model=qwen7b, overrides=six + ["vllm.max_model_len=8192"]), 1, 8, 74.5)
    assert ("activations at 8192 tokens (optim.token_budget=6144 real tokens packed, optim.packing=true; "
            "a row of up to 8192 tokens "
            "(vllm.max_model_len) is a micro-batch of its own): 45.1 GiB") in _learner_line(out)
    # no server limit: the model's own context bounds a row
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN7B, max_position_embeddings=32768)))
    out, errors = build(load_config("grpo", model=str(tmp_path), overrides=six), 1, 8, 74.5)
    assert "a row of up to 32768 tokens (the model's context, vllm.max_model_len unset)" in _learner_line(out)
    assert errors == ["a learner rank needs 218.8 GiB but has 70.0 GiB of its GPU (6 rank(s), ZeRO stage 3): use "
                      "vllm.max_model_len=8237 or model.gradient_checkpointing=true"]
    _, errors = build(load_config("grpo", model=str(tmp_path), overrides=six + ["vllm.max_model_len=16384"]), 1, 8,
                      74.5)
    assert errors == ["a learner rank needs 119.4 GiB but has 70.0 GiB of its GPU (6 rank(s), ZeRO stage 3): use "
                      "vllm.max_model_len=8237 or model.gradient_checkpointing=true"]


def test_fewer_groups_than_ranks_is_the_runs_own_refusal(qwen7b):
    from agentrl.config import ConfigError
    from agentrl.preflight import check_launch

    cfg = load_config("grpo", model=qwen7b, overrides=SIX + ["rollout.groups=4"])
    _, errors = build(cfg, 1, 8, 74.5)
    line = ("rollout.groups=4 is fewer than the 6 ranks: each rank rolls out whole groups, so set rollout.groups >= 6 "
            "(or launch fewer ranks)")
    assert errors == [line]
    with pytest.raises(ConfigError) as e:  # the run on 6 ranks: the same line
        check_launch(load_config("grpo", model=qwen7b, overrides=DS[:2] + ["rollout.groups=4"]), "cpu", 6)
    assert str(e.value) == line


@pytest.mark.parametrize("over,needs", [
    ([], False), (["algo.kl=k1"], False), (["algo.kl=k1", "algo.kl_coef=0.01"], True),
    (["algo.kl_reward_coef=0.01"], True)])
def test_one_definition_of_a_kl_reference(qwen7b, over, needs):
    from agentrl.trainer import Trainer

    cfg = load_config("grpo", model=qwen7b, overrides=SIX + over)
    assert cfg.algo.needs_reference is needs
    assert Trainer.needs_reference.fget(type("T", (), {"cfg": cfg})()) is needs  # the trainer asks the config
    out, _ = build(cfg, 1, 8, 74.5)
    assert ("reference 0.0 GiB" in _learner_line(out)) is not needs  # so does the plan


def test_the_plan_reads_the_packed_layout_and_the_vocabulary_chunk(qwen7b):
    """The quickstart's 7B rank: packed micro-batches count real tokens (the same 8,192-position bound, no
    padding in it); a vocabulary chunk of 1,024 of the 1,638 generated positions charges that chunk's logits."""
    six = DS + ["trainer.vllm_servers=2", "trainer.vllm_gpus=[6,7]", "optim.token_budget=6144",
                "vllm.max_model_len=8192"]
    base, _ = plan(qwen7b, six)
    assert "+ logits of 1638 generated positions 4.6 GiB = 69.7 GiB of 70.0 GiB" in _learner_line(base)
    out, errors = plan(qwen7b, six + ["optim.logits_chunk=1024", "optim.packing=true"])
    line = _learner_line(out)
    assert "activations at 8192 tokens (optim.token_budget=6144 real tokens packed, optim.packing=true;" in line
    assert ("+ logits of one 1024-position chunk of 1638 generated (optim.logits_chunk=1024) 2.9 GiB = 68.0 GiB"
            in line) and errors == []


QWEN15B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def test_the_guides_plans_are_the_clis_as_printed(tmp_path, monkeypatch, capsys):
    """docs/guides/gpu.md's layouts: each command's `--dry-run` prints the page's plan block exactly, and the
    learner line of the chunked and packed variant is the CLI's."""
    import re
    import shlex
    from pathlib import Path

    from agentrl import cli

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "guides" / "gpu.md").read_text()
    for name, cfg in (("Qwen2.5-7B-Instruct", QWEN7B), ("Qwen2.5-1.5B-Instruct", QWEN15B)):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=32768)))
    (tmp_path / "configs").symlink_to(root / "configs")
    monkeypatch.chdir(tmp_path)  # the page's relative model folders and DeepSpeed configs
    # a bash block, prose up to its `--dry-run ...` flags (no other block between), the text block of the plan
    layouts = re.findall(r"```bash\n([^`]*)```\n\n(?:(?!```).)*?`(--dry-run[^`]*)`:\n\n```text\n(launch plan:[^`]*)```",
                         page, re.S)
    assert len(layouts) == 3
    first = None
    for command, dry, want in layouts:
        args = shlex.split(command.replace("\\\n", " "))
        args = args[args.index("train"):] + shlex.split(dry)
        first = first or args
        assert cli.main(args) == 0
        assert capsys.readouterr().out == want, args
    variant = re.search(r"`(optim\.logits_chunk=\d+)`\nadded.*?```text\n(.*?)\n```", page, re.S)
    assert cli.main(first + variant.group(1).split()) == 0
    assert variant.group(2) in capsys.readouterr().out.splitlines()


def test_the_runs_preflight_on_a_gpu_reads_the_plans_estimate(qwen7b, monkeypatch):
    """On CUDA the run checks its learner rank against the GPU with the plan's own function and line."""
    import types

    import torch

    from agentrl.preflight import check_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=int(74.5 * 2**30)))
    over = DS + ["trainer.vllm_servers=2", "trainer.vllm_gpus=[6,7]", "optim.token_budget=20480"]
    cfg = load_config("grpo", model=qwen7b, overrides=over)
    _, errors = build(cfg, 1, 8, 74.5)
    assert errors and check_memory(cfg, "cuda:0", 6) == errors[0]  # the same line, its fixes too
    fits = load_config("grpo", model=qwen7b, overrides=over[:-1] + ["optim.token_budget=6144",
                                                                   "vllm.max_model_len=8192"])
    assert check_memory(fits, "cuda:0", 6) == ""
    # colocated: the server's share of the GPU is not the learner's
    coloc = load_config("grpo", model=qwen7b, overrides=DS + ["vllm.colocate=true", "vllm.gpu_memory_utilization=0.5",
                                                              "optim.token_budget=6144", "vllm.max_model_len=8192"])
    assert check_memory(coloc, "cuda:0", 6).startswith("a learner rank needs 69.7 GiB but has 32.8 GiB")
