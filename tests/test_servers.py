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
    import agentrl.recipes  # noqa: F401
    from agentrl.config import load_config
    from agentrl.recipe import RECIPES
    from agentrl.trainer import Trainer

    cfg = load_config("grpo", env="sokoban", overrides=[f"model.name={model_dir}", f"trainer.out_dir={tmp_path}",
                                                         "sft.enabled=false", "trainer.tensorboard=false",
                                                         "trainer.generator=vllm", *extra])
    return Trainer(cfg, RECIPES.get(cfg.method)(cfg))


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
