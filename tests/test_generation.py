"""Generation backends and the rollout engine: token-exact records, log-prob parity, server/client."""
import json
import re
import urllib.request

import pytest
import torch

from agentrl.generation.base import chat_ids
from agentrl.generation.client import GenerationServerError, RemoteGenerator, check_sync
from agentrl.generation.embedded import sample_from_logits
from agentrl.generation.server import start_server
from agentrl.learner.logprobs import completion_logprobs
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import SamplingParams
from agentrl.envs import make
from agentrl.envs.pool import InProcessEnvs
from agentrl.envs.replay import run_expert

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7, stop=["</answer>"])


def _engine(gen, tok, mode="window", env="sokoban", slots=4, **kw):
    return RolloutEngine(gen, tok, InProcessEnvs(env, slots), env,
                         RolloutConfig(max_turns=3, chat_mode=mode, sampling=SAMPLING, **kw))


@pytest.mark.parametrize("mode", ["window", "full"])
def test_rollout_logprobs_match_learner(tiny_generator, mode):
    g = tiny_generator
    eps = _engine(g, g.tokenizer, mode).run([Start(f"train/{i:05d}", 0, f"g{i // 2}") for i in range(4)])
    turns = [t for ep in eps for t in ep.turns]
    assert len(turns) == 12 and all(len(t.gen_ids) == len(t.gen_logprobs) > 0 for t in turns)
    worst = max(abs(a - b) for t in turns for a, b in
                zip(completion_logprobs(g.model, t.prompt_ids, t.gen_ids), t.gen_logprobs))
    assert worst < 1e-4


def test_full_mode_keeps_generated_ids_verbatim(tiny_generator):
    g = tiny_generator
    ep = _engine(g, g.tokenizer, "full").run([Start("train/00001")])[0]
    for prev, nxt in zip(ep.turns, ep.turns[1:]):
        assert nxt.prompt_ids[:len(prev.prompt_ids) + len(prev.gen_ids)] == prev.prompt_ids + prev.gen_ids
        assert "<|im_start|>user" in g.tokenizer.decode(nxt.prompt_ids[len(prev.prompt_ids) + len(prev.gen_ids):])


class ScriptedGenerator:
    """Test double: answers every prompt with a fixed text (token ids from the tokenizer)."""

    def __init__(self, tok, text):
        self.tok, self.text = tok, text

    def generate(self, prompts, sampling, seeds=None):
        from agentrl.types import Completion

        ids = self.tok(self.text, add_special_tokens=False)["input_ids"]
        return [Completion(list(ids), [-1.0] * len(ids), self.text, "stop") for _ in prompts]


def test_engine_steps_envs_and_records_episode(tiny_generator):
    tok = tiny_generator.tokenizer
    env = make("sokoban")
    trace, observations, _ = run_expert(env, "train/00021")
    moves = " || ".join(trace.actions[:3])
    eng = _engine(ScriptedGenerator(tok, f"<think>go</think><answer>{moves}</answer>"), tok, slots=2)
    ep = eng.run([Start("train/00021")])[0]
    first = ep.turns[0]
    assert first.format_ok and first.actions == trace.actions[:3]
    assert first.observation == observations[3] and first.fingerprints == trace.fingerprints[1:4]
    assert ep.initial_observation == observations[0] and ep.env_actions[:3] == trace.actions[:3]
    assert observations[3] in tok.decode(ep.turns[1].prompt_ids)  # the next prompt shows the new board


def test_restored_start_and_format_penalty(tiny_generator):
    tok = tiny_generator.tokenizer
    env = make("webshop")
    task = env.tasks("train")[0].task_id
    trace, observations, _ = run_expert(env, task)
    eng = _engine(ScriptedGenerator(tok, "no tags here"), tok, env="webshop", slots=1, format_penalty=-0.1)
    ep = eng.run([Start(task, trace=trace, t0=2, history=list(zip(observations, trace.actions))[:2])])[0]
    assert ep.start_index == 2 and ep.prefix_actions == trace.actions[:2]
    assert ep.initial_observation == observations[2]
    assert all(not t.format_ok and t.actions == [] and t.reward == pytest.approx(-0.1) for t in ep.turns)
    prompt = tok.decode(ep.turns[0].prompt_ids)
    assert ep.truncated and "already taken 2 step(s)" in prompt and trace.actions[1] in prompt


def test_sampling_rules():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    tok, lp = sample_from_logits(logits, SamplingParams(temperature=0.0), None)
    assert tok.item() == 1 and lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    gen = torch.Generator().manual_seed(0)
    draws = {sample_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6), gen)[0].item() for _ in range(200)}
    assert draws <= {1, 2} and draws == {1, 2}  # the nucleus is tokens 1 and 2


def test_stop_string_and_length(tiny_generator):
    g = tiny_generator
    prompt = chat_ids(g.tokenizer, [{"role": "user", "content": "hello"}])
    out = g.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=5, seed=1))[0]
    assert len(out.ids) <= 5 and out.finish_reason in ("length", "stop")
    # stop strings end generation as soon as they appear in the text
    forced = g.generate([prompt] * 8, SamplingParams(temperature=1.0, max_new_tokens=40, seed=2, stop=["e"]))
    assert all(o.finish_reason == "length" or "e" in o.text for o in forced)


@pytest.fixture(scope="module")
def server(tiny_generator, tmp_path_factory):
    srv = start_server(tiny_generator, "tiny-test", port=0, allow_weights_dirs=[str(tmp_path_factory.getbasetemp())])
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_remote_client_gives_the_same_episodes(tiny_generator, server):
    g = tiny_generator
    client = RemoteGenerator(server)
    assert client.model == "tiny-test"
    starts = [Start(f"train/{i:05d}", 0, "g") for i in range(3)]
    local = _engine(g, g.tokenizer).run(starts)
    remote = _engine(client, g.tokenizer).run(starts)
    for a, b in zip(local, remote):
        assert a.to_dict().keys() == b.to_dict().keys() and len(a.turns) == len(b.turns)
        for ta, tb in zip(a.turns, b.turns):
            assert ta.prompt_ids == tb.prompt_ids and ta.gen_ids == tb.gen_ids  # same seed, same draws
            assert max(abs(x - y) for x, y in zip(ta.gen_logprobs, tb.gen_logprobs)) < 1e-5


def test_weight_sync_and_check(tiny_generator, tiny_model_dir, server, tmp_path):
    from agentrl.learner.models import load_model

    client = RemoteGenerator(server)
    ids = chat_ids(tiny_generator.tokenizer, [{"role": "user", "content": "Up"}]) + [5, 6, 7]
    assert check_sync(client, tiny_generator.model, ids) < 1e-5
    learner = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(GenerationServerError, match="differ"):
        check_sync(client, learner, ids)
    learner.save_pretrained(tmp_path / "new")
    client.load_weights(tmp_path / "new")
    assert check_sync(client, learner, ids) < 1e-4
    # Generator.receive: the engine exports a folder under the staging dir and the server loads it
    from agentrl.learner.engine import EngineConfig, TorchEngine

    engine = TorchEngine(tiny_model_dir, EngineConfig())
    with torch.no_grad():
        next(engine.model.parameters()).add_(0.05)
    assert "time_sync_s" in client.receive(engine, tmp_path / "staging")
    assert check_sync(client, engine.model, ids) < 1e-4
    client.load_weights(tiny_model_dir)  # put the original back for other tests
    assert check_sync(client, tiny_generator.model, ids) < 1e-5


def _post(url, body, headers=None, raw=None):
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.parametrize("body,code,words", [
    ({"prompt": {"x": 1}}, 400, "prompt must be"),
    ({"prompt": [1, 2, 3], "max_tokens": 2, "stop": [["x"]]}, 400, "'stop' must be"),  # killed the worker once
    ({"prompt": [1, 2, 3], "max_tokens": 10**9}, 400, "'max_tokens' must be an integer in [1,"),
    ({"prompt": [1, 2, 3], "max_tokens": -5}, 400, "'max_tokens'"),
    ({"prompt": [1, 2, 10**7]}, 400, "outside the vocabulary"),
    ({"prompt": [1, 2, 3], "n": -1}, 400, "'n' must be"),
    ({"prompt": [1, 2, 3], "temperature": "hot"}, 400, "'temperature'"),
    ({"prompt": "word " * 300_000}, 400, "longer than the model's context"),
    ([1, 2], 400, "JSON object"),
])
def test_server_rejects_bad_requests_and_keeps_serving(server, body, code, words):
    status, out = _post(server + "/v1/completions", body)
    assert status == code and words in out["error"]["message"]
    status, out = _post(server + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert status == 200 and len(out["choices"][0]["token_ids"]) <= 2


def test_a_denormal_temperature_or_a_tiny_top_p_is_a_greedy_draw(tiny_generator, server):
    """temperature 1e-40 overflowed logits / T to inf and the draw repeated the last token id; top_p 1e-300 (0 in
    float32) kept no token and drew token 0. Below GREEDY_BELOW a temperature is greedy wherever it is read (the
    sampler, the learner's log-probs, the server; a recipe refuses it), and top_p always keeps the top token."""
    import math

    from agentrl.config import ConfigError
    from agentrl.config_loader import load_config
    from agentrl.types import GREEDY_BELOW

    g = tiny_generator
    prompt = chat_ids(g.tokenizer, [{"role": "user", "content": "Up Left"}])
    greedy = g.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    assert SamplingParams(temperature=GREEDY_BELOW / 2).temperature == 0.0
    for sampling in (SamplingParams(temperature=1e-40, max_new_tokens=12, seed=3),
                     SamplingParams(temperature=1.0, top_p=1e-300, max_new_tokens=12, seed=3)):
        out = g.generate([prompt], sampling)[0]
        assert out.ids == greedy.ids and all(math.isfinite(x) for x in out.logprobs), sampling
    odd = SamplingParams()
    odd.temperature = 1e-40  # set after construction: the sampler still reads it as greedy
    logits = torch.randn(4, 50)
    tok, lp = sample_from_logits(logits, odd, torch.Generator().manual_seed(0))
    assert tok.tolist() == logits.argmax(-1).tolist() and torch.isfinite(lp).all()
    learner = completion_logprobs(g.model, prompt, greedy.ids, temperature=1e-40)
    assert max(abs(a - b) for a, b in zip(learner, greedy.logprobs)) < 1e-4
    for extra in ({"temperature": 1e-40}, {"top_p": 1e-300, "seed": 3}):
        status, out = _post(server + "/v1/completions", {"prompt": prompt, "max_tokens": 12, **extra})
        assert status == 200 and out["choices"][0]["token_ids"] == greedy.ids, extra
    with pytest.raises(ConfigError, match=r"'rollout.temperature': 1e-40; allowed: 0 \(greedy\) or >= 1e-05"):
        load_config("grpo", overrides=["rollout.temperature=1e-40"])


def test_server_refuses_huge_bodies_foreign_weights_and_serves_chat(server, tiny_model_dir, tmp_path):
    import http.client

    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(9 << 20))  # refused from the header, before any body is read
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    for path in ["/etc", "/nonexistent/x", "gpt2"]:  # outside the allowed dirs: 403, existing or not
        status, out = _post(server + "/load_weights", {"path": path})
        assert status == 403 and "not under a directory this server may load weights from" in out["error"]["message"]
    from agentrl.model_zoo import build_tiny
    from tests.conftest import CORPUS

    other = tmp_path / "other"  # another tiny model: same architecture class, other shapes
    build_tiny(other, corpus=CORPUS, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2)
    status, out = _post(server + "/load_weights", {"path": str(other)})
    assert status == 400 and "do not match the served model" in out["error"]["message"]
    status, out = _post(server + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Up"}],
                                                         "max_tokens": 3})
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"
    with pytest.raises(GenerationServerError, match="cannot reach"):
        RemoteGenerator("http://127.0.0.1:9", timeout=2)


def test_api_key_guards_every_route_but_health(tiny_generator):
    srv = start_server(tiny_generator, "tiny-test", port=0, api_key="s3cret")
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert _post(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})[0] == 401
        assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
        with pytest.raises(GenerationServerError, match="401"):
            RemoteGenerator(url, api_key="wrong")
        client = RemoteGenerator(url, api_key="s3cret")
        assert client.model == "tiny-test"
    finally:
        srv.shutdown()


def test_ineffective_turns_are_flagged_and_penalized(tiny_generator):
    """A move into a wall leaves the fingerprint unchanged: flagged and given ineffective_penalty."""
    tok = tiny_generator.tokenizer
    env = make("sokoban")
    for task in env.tasks("train"):
        env.reset(task.task_id)
        r, c = env.player
        if (r - 1, c) in env.level.walls and (r, c - 1) not in env.level.walls | env.boxes:
            break
    eng = _engine(ScriptedGenerator(tok, "<answer>Up</answer>"), tok, slots=1, ineffective_penalty=-0.5)
    ep = eng.run([Start(task.task_id)])[0]
    assert [t.info.get("ineffective", False) for t in ep.turns] == [True] * 3
    assert all(t.reward == pytest.approx(-0.1 - 0.5) for t in ep.turns)  # sokoban's step cost + the penalty
    eng = _engine(ScriptedGenerator(tok, "<answer>Left</answer>"), tok, slots=1, ineffective_penalty=-0.5)
    assert not eng.run([Start(task.task_id)])[0].turns[0].info.get("ineffective")  # a real move


def test_each_row_and_turn_gets_its_own_seed_and_batching_does_not_change_samples(tiny_generator):
    """One rollout seed must not re-draw the same random numbers every turn (that locks an episode to one
    quantile at its action token, turn after turn): every (episode, turn) gets its own seed. A row's
    draws depend on its own stream only, so the same starts sample the same tokens whether they share
    one batch or run one at a time (as on several ranks), and reruns are identical."""
    g = tiny_generator

    class Recording:  # records what the engine asks of the real generator
        def __init__(self):
            self.seeds, self.tokenizer, self.stop_ids = [], g.tokenizer, getattr(g, "stop_ids", ())

        def generate(self, prompts, sampling, seeds=None):
            self.seeds.append(list(seeds))
            return g.generate(prompts, sampling, seeds=seeds)

    starts = [Start(f"train/{i:05d}", 0, "g") for i in range(4)]
    runs = []
    for slots in (4, 4, 1):
        rec = Recording()
        eps = _engine(rec, g.tokenizer, slots=slots).run(starts)
        runs.append((sorted(s for call in rec.seeds for s in call), [[t.gen_ids for t in ep.turns] for ep in eps]))
    seeds = runs[0][0]
    assert len(seeds) == 12 and len(set(seeds)) == 12  # 4 episodes x 3 turns, all different
    assert runs[0] == runs[1]  # same rollout seed, same samples
    assert runs[2] == runs[0]  # one row per batch: the same seeds and the same tokens


def test_refilled_slots_give_the_same_episodes_in_fewer_calls(tiny_generator):
    """rollout.refill: a slot whose episode has ended takes the next start at once. Episodes come back in
    start order with the very tokens the waves gave (a row's draws do not depend on its batch), and with
    episodes of unequal length the slots wait less: 6 generate calls instead of 7 here."""
    g = tiny_generator

    class Counting:
        def __init__(self):
            self.calls, self.tokenizer, self.stop_ids = 0, g.tokenizer, getattr(g, "stop_ids", ())

        def generate(self, prompts, sampling, seeds=None):
            self.calls += 1
            return g.generate(prompts, sampling, seeds=seeds)

    starts = [Start(f"train/{i:05d}", 0, f"g{i}", max_turns=m) for i, m in enumerate([1, 3, 1, 1, 3, 1])]
    runs = []
    for refill in (False, True):
        gen = Counting()
        eps = _engine(gen, g.tokenizer, slots=2, refill=refill).run(starts)
        runs.append(([(ep.task_id, len(ep.turns), ep.truncated, [t.gen_ids for t in ep.turns]) for ep in eps],
                     gen.calls))
    assert [e[0] for e in runs[1][0]] == [s.task_id for s in starts]
    assert [e[1] for e in runs[1][0]] == [1, 3, 1, 1, 3, 1]
    assert runs[1][0] == runs[0][0]
    assert (runs[0][1], runs[1][1]) == (7, 6)


def test_vllm_requests_carry_no_shared_seed():
    """vLLM seeds every prompt of a request alike: a group's identical prompts would sample identically."""
    ours, vllm = RemoteGenerator("http://x", model="m"), RemoteGenerator("http://x", model="m", backend="vllm")
    assert ours._body([[1, 2]], SAMPLING)["seed"] == SAMPLING.seed
    assert "seed" not in vllm._body([[1, 2], [1, 2]], SAMPLING)


def test_constrained_decoding_answers_only_among_the_choices_with_renormalized_logprobs(tiny_generator):
    """Each constrained row's completion is one whole choice; each token's log-prob is under softmax over
    the ids that continue a choice (by hand from the model's logits); an unconstrained row is unchanged."""
    from agentrl.learner.logprobs import completion_logprobs

    g, tok = tiny_generator, tiny_generator.tokenizer
    prompt = chat_ids(tok, [{"role": "user", "content": "Push the box. Your move?"}])
    choices = [tok(f"<answer>{a}</answer>", add_special_tokens=False)["input_ids"]
               for a in ("Up", "Down", "Left", "Right")]
    for sampling in (SAMPLING, SamplingParams(temperature=0.0, max_new_tokens=24, stop=["</answer>"])):
        free = g.generate([prompt], sampling, seeds=[7])[0]
        outs = g.generate([prompt] * 5, sampling, seeds=[3, 4, 5, 6, 7], choices=[choices] * 4 + [None])
        assert all(o.ids in choices and o.finish_reason == "stop" for o in outs[:4])
        assert outs[4].ids == free.ids and outs[4].logprobs == pytest.approx(free.logprobs, abs=1e-4)
        assert outs[4].allowed == []
        for o in outs[:4]:
            assert len(o.allowed) == len(o.ids)
            for j, (t, allowed) in enumerate(zip(o.ids, o.allowed)):
                assert allowed == sorted({c[j] for c in choices if c[:j] == o.ids[:j]})
                with torch.no_grad():
                    logits = g.model(input_ids=torch.tensor([prompt + o.ids[:j]])).logits[0, -1].float()
                if sampling.temperature > 0:
                    logits = logits / sampling.temperature
                want = torch.log_softmax(logits[allowed], -1)[allowed.index(t)]
                assert abs(o.logprobs[j] - float(want)) < 1e-4
            # where only one id continues the choice, the token is certain: log-prob 0
            assert all(lp == pytest.approx(0.0, abs=1e-6) for lp, a in zip(o.logprobs, o.allowed) if len(a) == 1)
            if sampling.temperature == 0:  # greedy among the choices, not the free argmax
                assert o.ids != free.ids or free.ids in choices
        assert completion_logprobs(g.model, prompt, outs[0].ids) != outs[0].logprobs  # the free policy differs


def test_engine_constrains_answers_to_the_envs_admissible_actions(tiny_generator):
    """``constrain_actions``: every turn's answer is an admissible action (the untrained model mostly answers
    nonsense without it), and the turn keeps the ids each token was drawn among."""
    g = tiny_generator
    free = _engine(g, g.tokenizer).run([Start(f"train/{i:05d}", 0) for i in range(4)])
    eps = _engine(g, g.tokenizer, constrain_actions=True).run([Start(f"train/{i:05d}", 0) for i in range(4)])
    turns = [t for ep in eps for t in ep.turns]
    assert all(t.format_ok and not t.info["inadmissible"] and len(t.gen_allowed) == len(t.gen_ids) for t in turns)
    assert all(t.actions[0] in ("Up", "Down", "Left", "Right") for t in turns)
    assert not any(t.gen_allowed for ep in free for t in ep.turns)
    assert sum(not t.format_ok or t.info["inadmissible"] for ep in free for t in ep.turns) > len(turns) // 2
    # under the numbered prompt the answers are the actions' numbers, which the parser maps back
    eps = _engine(g, g.tokenizer, constrain_actions=True, prompt="numbered").run([Start("train/00000", 0)])
    assert all(re.fullmatch(r"<answer>\d+</answer>", t.text) and t.actions[0] in ("Up", "Down", "Left", "Right")
               and not t.info["inadmissible"] for t in eps[0].turns)


def test_trainer_started_vllm_servers_get_their_own_gpus(tmp_path, monkeypatch):
    """trainer.vllm_gpus: server k is started with CUDA_VISIBLE_DEVICES set to entry k (not rank 0's devices);
    fewer entries than servers is one config line."""
    from agentrl.config import ConfigError
    from agentrl.config_loader import load_config
    from agentrl.generation import vllm
    from agentrl.generation.client import GenerationServerError
    from agentrl.generation.vllm_fleet import VLLMFleet

    cfg = load_config("grpo", env="sokoban", overrides=["trainer.generator=vllm", "trainer.vllm_servers=2",
                                                        "trainer.vllm_gpus=[6, '4,5']"])
    envs: list[str | None] = []

    class Started(Exception):
        pass

    def popen(cmd, env=None, **kw):
        envs.append(env.get("CUDA_VISIBLE_DEVICES"))
        raise Started

    monkeypatch.setattr(vllm, "vllm_python", lambda: "python")
    monkeypatch.setattr(vllm.subprocess, "Popen", popen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for gpus in cfg.trainer.vllm_gpus:
        with pytest.raises(Started):
            vllm.VLLMServer(tmp_path, gpus=str(gpus)).start()
    with pytest.raises(Started):
        vllm.VLLMServer(tmp_path).start()  # no entry: the process's own devices
    assert envs == ["6", "4,5", "0"]

    starts = []

    def start(self, timeout=0):
        starts.append(self.gpus)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(vllm.VLLMServer, "start", start)
    with pytest.raises(GenerationServerError):
        VLLMFleet(cfg.trainer, tmp_path, "cpu", tmp_path)
    assert starts == ["6"]  # the fleet gives server 0 the first entry (its start fails here, so no second)
    with pytest.raises(ConfigError, match=r"trainer.vllm_gpus lists 1 device sets for trainer.vllm_servers=2"):
        load_config("grpo", env="sokoban", overrides=["trainer.generator=vllm", "trainer.vllm_servers=2",
                                                      "trainer.vllm_gpus=[6]"])


def test_each_adapter_load_gets_a_new_name():
    """Two adapter loads in the same millisecond (or two trainers on one vLLM server) never share a name: a
    reused name would make the server keep serving the older adapter."""
    from agentrl.generation.client import RemoteGenerator

    sent = []
    gen = RemoteGenerator("http://127.0.0.1:1", model="m")
    gen.request = lambda method, path, body=None: sent.append(body) or {}  # records, no server
    for _ in range(3):
        gen.load_weights("/adapter", lora=True)
    names = [b["lora_name"] for b in sent]
    assert len(set(names)) == 3 and gen.lora_name == names[-1]


def test_a_repeated_prompt_is_prefilled_once_and_samples_as_if_alone(tiny_generator, monkeypatch):
    """GRPO's group repeats its prompt: the prefill runs each distinct prompt once and copies its cache
    rows; every row then samples the tokens (and log-probs) it samples alone, with its own seed."""
    from agentrl.generation import embedded

    g = tiny_generator
    a, b = chat_ids(g.tokenizer, [{"role": "user", "content": "pick an arm"}]), [5, 6, 7, 8, 9, 10]
    prompts, seeds = [a, b, a, a, b], [11, 12, 13, 14, 15]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    widths = []
    prefill = embedded.EmbeddedGenerator._prefill
    monkeypatch.setattr(embedded.EmbeddedGenerator, "_prefill",
                        lambda self, ps, n: widths.append(len(ps)) or prefill(self, ps, n))
    together = g.generate(prompts, sampling, seeds=seeds)
    assert widths == [2]  # its two distinct prompts
    alone = [g.generate([p], sampling, seeds=[s])[0] for p, s in zip(prompts, seeds)]
    assert [c.ids for c in together] == [c.ids for c in alone]
    for c, d in zip(together, alone):
        assert c.logprobs == pytest.approx(d.logprobs, abs=1e-4)


LAYOUTS = {  # prompts by index into three token lists: (a, b, c) share a 40-token prefix, d shares nothing
    "GRPO groups": [0, 0, 0, 1, 1, 1, 2, 2, 2],
    "distinct prompts": [0, 1, 2],
    "groups out of order, of unequal sizes, one without a shared prefix": [2, 0, 3, 0, 2, 1, 0],
    "one prompt repeated": [1, 1, 1, 1],
    "one row": [3],
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_the_cascade_decode_samples_what_the_static_cache_samples(tiny_generator, monkeypatch, layout):
    """The decode that reads each shared prefix and each distinct prompt once a step (``cascade``) samples
    the same tokens with the same log-probs as attention over a static cache of every row's copy, while
    rows end at different steps (a stop id every 7 ids) and leave the batch."""
    from agentrl.generation import cascade

    g = tiny_generator
    torch.manual_seed(0)
    vocab = g.model.config.vocab_size
    shared = torch.randint(10, vocab, (40,)).tolist()
    pool = [shared + torch.randint(10, vocab, (n,)).tolist() for n in (20, 23, 5)]
    pool.append(torch.randint(10, vocab, (9,)).tolist())
    prompts = [pool[i] for i in LAYOUTS[layout]]
    seeds = list(range(len(prompts)))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30)
    monkeypatch.setattr(g, "stop_ids", set(range(0, vocab, 7)))
    assert cascade.applies(g.model)
    steps = []
    monkeypatch.setattr(cascade.CascadeCache, "advance",
                        lambda self, f=cascade.CascadeCache.advance: steps.append(1) or f(self))
    fast = g.generate(prompts, sampling, seeds=seeds)
    monkeypatch.setattr(cascade, "applies", lambda model: False)
    plain = g.generate(prompts, sampling, seeds=seeds)
    assert steps and len({len(c.ids) for c in plain}) > 1 or len(prompts) == 1  # it ran; rows ended apart
    assert [c.ids for c in fast] == [c.ids for c in plain]
    for c, d in zip(fast, plain):
        assert c.logprobs == pytest.approx(d.logprobs, abs=1e-5)


def test_two_threads_generating_on_one_model_sample_what_each_samples_alone(tiny_generator):
    """A server's worker still decoding a cancelled batch while the next batch starts on the same model: each
    forward pass picks its attention by what it carries, so neither disturbs the other."""
    import threading

    g = tiny_generator
    a = [chat_ids(g.tokenizer, [{"role": "user", "content": f"pick arm {i}"}]) for i in range(3)] * 2
    b = [[5, 6, 7, 8, 9, 10, 11, 12][: 3 + i] for i in range(5)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)
    alone = [g.generate(a, sampling, seeds=list(range(6))), g.generate(b, sampling, seeds=list(range(5)))]
    together: list = [None, None]
    def run(k, prompts):
        together[k] = g.generate(prompts, sampling, seeds=list(range(len(prompts))))

    threads = [threading.Thread(target=run, args=(k, p)) for k, p in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, y in zip(together, alone):
        assert [c.ids for c in x] == [c.ids for c in y]


def test_the_cascade_decode_of_a_model_with_grouped_query_heads(tiny_generator, monkeypatch):
    """8 query heads over 2 key/value heads and biased projections (a Qwen2 layout): the same samples."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.generation import cascade
    from agentrl.generation.embedded import EmbeddedGenerator

    tok = tiny_generator.tokenizer
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config)
    g = EmbeddedGenerator(model.eval(), tok, [], "cpu")
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 3 + [20 + i] * (i + 1) for i in range(3) for _ in range(2)] + [[40, 41]]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    assert cascade.applies(model)
    fast = g.generate(prompts, sampling, seeds=list(range(len(prompts))))
    monkeypatch.setattr(cascade, "applies", lambda model: False)
    plain = g.generate(prompts, sampling, seeds=list(range(len(prompts))))
    assert [c.ids for c in fast] == [c.ids for c in plain]
    for c, d in zip(fast, plain):
        assert c.logprobs == pytest.approx(d.logprobs, abs=1e-5)


def test_the_cascade_decode_applies_only_where_every_layer_sees_the_whole_sequence_through_sdpa():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    from agentrl.generation import cascade

    class Model:
        def __init__(self, config):
            self.config = config

    assert cascade.applies(Model(LlamaConfig(attn_implementation="sdpa")))
    assert not cascade.applies(Model(LlamaConfig(attn_implementation="eager")))
    assert not cascade.applies(Model(MistralConfig(sliding_window=4096, attn_implementation="sdpa")))
    assert not cascade.applies(Model(Gemma2Config(attn_implementation="sdpa")))  # soft-capped logits, sliding layers
    cache = cascade.CascadeCache([cascade.Level([torch.zeros(1, 2, 3, 4)], [torch.zeros(1, 2, 3, 4)], None,
                                                torch.zeros(2, dtype=torch.long))], rows=2, max_new=4)
    with pytest.raises(RuntimeError, match="did not attend through the cascade cache"):
        cache.advance()  # a forward pass whose layers ran another attention over the rows' own keys only
