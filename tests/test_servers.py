"""Several generation servers as one generator (real `agentrl serve` HTTP servers on loopback), and the
shared-memory weight hand-over that vLLM's workers read (the vLLM side runs in `make test-vllm`)."""
import json
import types

import pytest
import torch

from agentrl.generation.client import GenerationServerError, RemoteGenerator
from agentrl.generation.server import start_server
from agentrl.generation.servers import ServerPool
from agentrl.types import SamplingParams

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)


def _servers(gen, n):
    return [start_server(gen, "tiny-test", port=0) for _ in range(n)]


def _kill(srv):
    srv.shutdown()
    srv.server_close()  # connections are refused from now on, as from a dead process


def test_pool_keeps_groups_together_and_survives_a_dead_server(tiny_generator):
    g = tiny_generator
    servers = _servers(g, 2)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    pool = ServerPool({u: RemoteGenerator(u) for u in urls}, retries=2, backoff_s=0.01)
    calls = []
    for u, c in pool.clients.items():  # record which server got which prompts
        real = c.generate
        c.generate = lambda p, s, seeds=None, _u=u, _r=real: (calls.append((_u, [tuple(x) for x in p]))
                                                              or _r(p, s, seeds))
    a, b = [1, 2, 3, 4], [5, 6, 7]
    prompts, seeds = [a, a, a, b, b, b], [11, 12, 13, 14, 15, 16]
    out = pool.generate(prompts, SAMPLING, seeds)
    assert len(out) == 6 and all(o.ids for o in out)
    assert sorted(len(p) for _, p in calls) == [3, 3] and {len(set(p)) for _, p in calls} == {1}  # a group per server
    assert [o.ids for o in out] == [o.ids for o in g.generate(prompts, SAMPLING, seeds=seeds)]  # per-row streams
    try:
        _kill(servers[1])
        out = pool.generate(prompts, SAMPLING, seeds)  # the dead server's group goes to the other one
        assert len(out) == 6 and all(o.ids for o in out)
        assert list(pool.dead) == [urls[1]] and "died mid-step" in pool.dead[urls[1]]
        _kill(servers[0])
        with pytest.raises(GenerationServerError, match="every generation server is gone"):
            pool.generate(prompts, SAMPLING, seeds)
    finally:
        for s in servers:
            s.server_close()


def test_a_server_that_misses_a_sync_is_never_sampled_again(tiny_generator):
    servers = _servers(tiny_generator, 2)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    pool = ServerPool({u: RemoteGenerator(u) for u in urls}, retries=0)

    class Sync:  # the second server refuses the weights
        def push(self, clients, weights):
            list(weights)
            return {urls[1]: "refused"}

    pool.push_weights(Sync(), iter([("w", torch.zeros(1))]))
    assert pool.live == [urls[0]] and "missed a weight sync" in pool.dead[urls[1]]
    out = pool.generate([[1, 2, 3]] * 4, SAMPLING, [1, 2, 3, 4])
    assert len(out) == 4
    for s in servers:
        _kill(s)


def test_shared_memory_weights_round_trip_into_the_worker_extension(tiny_model_dir, tmp_path, monkeypatch):
    """What vLLM's worker receives is exactly the learner's tensors, by name; other paths are refused."""
    from agentrl.generation.vllm_ext import SharedMemoryWeights
    from agentrl.generation.vllm_sync import SharedMemorySync
    from agentrl.learner.engine import TorchEngine

    monkeypatch.setenv("AGENTRL_SHM_DIR", str(tmp_path))
    eng = TorchEngine(tiny_model_dir)
    path, manifest = SharedMemorySync(str(tmp_path)).write(eng.iter_weights())
    got = {}
    worker = SharedMemoryWeights()
    worker.model_runner = types.SimpleNamespace(reload_weights=lambda weights_iterator, is_checkpoint_format:
                                                got.update({n: t.clone() for n, t in weights_iterator}))
    worker.get_model = lambda: torch.nn.Linear(1, 1)  # no tied embedding to redo
    assert worker.agentrl_load_shm(manifest)["loaded"] == len(dict(eng.model.named_parameters()))
    for name, p in eng.model.named_parameters():
        assert torch.equal(got[name], p.detach()), name
    outside = tmp_path.parent / "agentrl-weights-x"
    outside.write_bytes(path.read_bytes())
    bad = json.loads(manifest)
    bad["path"] = str(outside)
    with pytest.raises(ValueError, match="refusing to load weights"):
        worker.agentrl_load_shm(json.dumps(bad))


def _trainer(tmp_path, model_dir, *extra):
    from agentrl import Trainer
    from agentrl.config import load_config

    cfg = load_config("grpo", env="sokoban", overrides=[f"model.name={model_dir}", f"trainer.out_dir={tmp_path}",
                                                         "sft.enabled=false", "trainer.tensorboard=false",
                                                         "trainer.generator=vllm", *extra])
    return Trainer.from_config(cfg)


def test_vllm_generator_bad_servers_fail_before_any_work(tiny_generator, tiny_model_dir, tmp_path):
    from agentrl.launch import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(GenerationServerError, match=f"generation server {dead} does not answer"):
        _trainer(tmp_path, tiny_model_dir, f"trainer.generator_url={dead}")
    # a server without the in-place weight routes (our own server stands in for a vLLM that lacks them)
    srv = start_server(tiny_generator, "tiny-test", port=0)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(GenerationServerError, match="no generation server took the weight sync .*HTTP 404"):
            _trainer(tmp_path, tiny_model_dir, f"trainer.generator_url=[{url}]")
    finally:
        _kill(srv)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_request_the_server_rejects_is_raised_not_routed_around():
    """HTTP 4xx means the request is bad, not the server: no retry, no server marked dead."""
    class Rejecting:  # a stand-in client: the server answered 400
        def __init__(self):
            self.calls = 0

        def generate(self, prompts, sampling, seeds=None):
            self.calls += 1
            raise GenerationServerError("POST /v1/completions: HTTP 400: prompt too long", 400)

    a, b = Rejecting(), Rejecting()
    pool = ServerPool({"a": a, "b": b}, retries=3, backoff_s=0.01)
    with pytest.raises(GenerationServerError, match="refused the request: .*HTTP 400"):
        pool.generate([[1, 2], [3, 4]], SAMPLING)
    assert pool.live == ["a", "b"] and a.calls == 1 and b.calls == 1


def _answers(tok, texts):
    return [tok(f"<answer>{t}</answer>", add_special_tokens=False)["input_ids"] for t in texts]


def test_constrained_decoding_through_servers_matches_the_embedded_generator(tiny_generator):
    """`choices` through the pool to real `agentrl serve` servers: each completion is one of its answers,
    drawn from the same per-row streams as in process, with the same log-probs and the same allowed ids
    (which the client fills by walking the answers); a free row in the same call stays free."""
    g = tiny_generator
    servers = _servers(g, 2)
    try:
        pool = ServerPool({f"http://127.0.0.1:{s.server_address[1]}": RemoteGenerator(
            f"http://127.0.0.1:{s.server_address[1]}") for s in servers}, retries=1, backoff_s=0.01)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
        a, b = [1, 2, 3, 4], [5, 6, 7]
        moves = _answers(g.tokenizer, ["Up", "Down", "Left", "Right"])
        prompts, seeds = [a, a, b, b], [11, 12, 13, 14]
        choices = [moves, moves[:2], None, moves]
        got = pool.generate(prompts, sampling, seeds, choices)
        ref = g.generate(prompts, sampling, seeds=seeds, choices=choices)
        assert [o.ids for o in got] == [o.ids for o in ref]
        assert [o.allowed for o in got] == [o.allowed for o in ref]
        assert all(o.ids in c for o, c in zip(got, choices) if c) and got[2].allowed == []
        assert got[1].ids in moves[:2]
        for o, r in zip(got, ref):
            assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    finally:
        for s in servers:
            _kill(s)


def test_the_server_refuses_malformed_choices_and_the_client_refuses_an_unconstrained_answer(tiny_generator):
    srv = start_server(tiny_generator, "tiny-test", port=0)
    try:
        client = RemoteGenerator(f"http://127.0.0.1:{srv.server_address[1]}")
        body = dict(model=client.model, prompt=[[1, 2, 3]], max_tokens=4, choice_token_ids=[[[1, 2]], None])
        with pytest.raises(GenerationServerError, match=r"HTTP 400.*'choice_token_ids'.*one entry per prompt"):
            client._request("POST", "/v1/completions", body)
        body["choice_token_ids"] = [[[1, 2, 3, 4, 5]]]  # longer than max_tokens: it could never be finished
        with pytest.raises(GenerationServerError, match=r"HTTP 400.*'choice_token_ids'"):
            client._request("POST", "/v1/completions", body)
    finally:
        _kill(srv)
    vllm = RemoteGenerator("http://127.0.0.1:1", model="policy", backend="vllm")
    assert vllm._allowed([1, 3], [[1, 2], [1, 3, 4], [1, 3]], 0) == [[1], [2, 3]]
    assert vllm._allowed([1, 2, 0], [[1, 2], [1, 3]], 0) == [[1], [2, 3], [0]]  # then end-of-sequence
    with pytest.raises(GenerationServerError, match=r"completion 5 is not one of the 2 answers.*--logits-processors"
                                                    r" agentrl.generation.vllm_choices:ChoiceLogits") as e:
        vllm._allowed([7, 7], [[1, 2], [1, 3]], 5)
    assert e.value.refused  # a misconfigured server: raised at once, not retried on another


def test_the_vllm_choice_table_allows_what_the_embedded_trie_allows():
    from agentrl.generation.embedded import along_choices
    from agentrl.generation.vllm_choices import ChoiceMask, parse_choices

    choices = [[1, 2], [1, 3, 4], [5]]
    mask = ChoiceMask(choices, end_ids=[0])
    for c in choices:  # every prefix of every answer: the trie's allowed ids; after a whole answer, the end
        assert [mask.allowed(c[:k]) for k in range(len(c))] == along_choices(c, choices)
        assert mask.allowed(c) == [0]
    assert mask.allowed([9]) is None
    logits = torch.arange(8, dtype=torch.float32)
    out = mask([1], logits.clone())
    assert torch.isinf(out).sum() == 6 and out[2] == 2.0 and out[3] == 3.0
    assert torch.equal(mask([9], logits), logits)  # off the table: left alone (the client reports it)
    assert parse_choices("[[1, 2], [3]]") == [[1, 2], [3]]
    for bad in ("[[1, 2], []]", "[]", "{\"a\": 1}", "[[1.5]]", "not json"):
        with pytest.raises(ValueError, match="agentrl_choices"):
            parse_choices(bad)


def test_constrained_rollouts_through_a_server_equal_in_process_ones(tiny_generator):
    """The rollout engine with ``constrain_actions`` driving `agentrl serve`: the same turns, answers and
    allowed ids (what the learner masks to) as with the generator in process."""
    from agentrl.envs.pool import InProcessEnvs
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start

    g = tiny_generator
    cfg = RolloutConfig(max_turns=3, constrain_actions=True,
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=16, seed=5))
    starts = [Start(f"train/{i:05d}", 0) for i in range(4)]
    srv = start_server(g, "tiny-test", port=0)
    try:
        remote = RemoteGenerator(f"http://127.0.0.1:{srv.server_address[1]}")
        served = RolloutEngine(remote, g.tokenizer, InProcessEnvs("sokoban", 4), "sokoban", cfg).run(starts)
    finally:
        _kill(srv)
    local = RolloutEngine(g, g.tokenizer, InProcessEnvs("sokoban", 4), "sokoban", cfg).run(starts)
    turns = [[(t.gen_ids, t.gen_allowed, t.actions) for t in ep.turns] for ep in served]
    assert turns == [[(t.gen_ids, t.gen_allowed, t.actions) for t in ep.turns] for ep in local]
    assert all(t.gen_allowed and not t.info["inadmissible"] for ep in served for t in ep.turns)
