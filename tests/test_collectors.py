"""The run's collector (agentrl.rollout.collector): one step path for on-policy, collect-ahead and continuous
runs, and the continuous population's rules (versions per token, the staleness bound, resume)."""
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import ConfigError
from agentrl.config_loader import load_config
from agentrl.types import Episode, Turn
from tests.test_staleness import kill_after, rows, small

MODES = {  # the three collectors, each as a run's overrides
    "now": (),
    "ahead": ("trainer.max_staleness=1",),
    "continuous": ("rollout.mode=continuous", "trainer.max_staleness=1"),
}


def _run_recording(cfg, trained):
    """A run whose recipe's learn records the group ids of each step's episodes (``trained``: step -> ids)."""
    from agentrl import Trainer

    t = Trainer.from_config(cfg)
    learn = t.recipe.learn

    def recorded(trainer, episodes, collected):
        trained[trainer.step] = [e.group_id for e in episodes]
        return learn(trainer, episodes, collected)

    t.recipe.learn = recorded
    try:
        t.train()
        return t
    finally:
        t.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_collector_runs_the_one_step_path_and_resumes(mode, tiny_model_dir, tmp_path, monkeypatch):
    """The same trainer path for each collector: a step trains on rollout.groups whole groups, never older
    than trainer.max_staleness versions; a run stopped after a checkpoint resumes with every step logged
    once and no group trained twice (on-policy and collect-ahead: the very metrics of the whole run)."""
    from agentrl.recipe import Recipe
    from agentrl.trainer import Trainer

    assert not hasattr(Trainer, "_overlapped_step") and not hasattr(Recipe, "step")
    args = ("rollout.groups=2", "rollout.group_size=2", "rollout.slots=8", "trainer.steps=4", *MODES[mode])
    trained: dict[int, list[str]] = {}
    whole = _run_recording(load_config("grpo", env="bandit", overrides=small(tmp_path / "whole", tiny_model_dir,
                                                                                  *args)), trained)
    got = rows(tmp_path / "whole")
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    assert sorted(trained) == [0, 1, 2, 3]
    for ids in trained.values():
        assert len(ids) == 4 and len(set(ids)) == 2 and all(ids.count(g) == 2 for g in ids)  # whole groups
    if mode == "now":
        assert not any("staleness" in k for r in got for k in r)
    else:
        assert all(r["staleness_max"] <= 1 for r in got[1:])
    if mode == "continuous":
        every = [g for ids in trained.values() for g in set(ids)]
        assert len(every) == len(set(every))  # no group twice
        assert all(r.get("staleness_token_max", 0) <= 1 for r in got[1:])
        assert type(whole.collector).__name__ == "ContinuousCollector"

    undo = kill_after(monkeypatch, 2)
    cfg = load_config("grpo", env="bandit", overrides=small(tmp_path / "killed", tiny_model_dir, *args))
    first: dict[int, list[str]] = {}
    with pytest.raises(KeyboardInterrupt):
        _run_recording(cfg, first)
    undo()
    second: dict[int, list[str]] = {}
    _run_recording(cfg, second)
    assert sorted(first) == [0, 1] and sorted(second) == [2, 3]
    resumed = rows(tmp_path / "killed")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    if mode == "continuous":  # which groups fill a step depends on timing; none is trained twice
        every = [g for part in (first, second) for ids in part.values() for g in set(ids)]
        assert len(every) == len(set(every))
    else:
        assert resumed == got and {**first, **second} == trained


# ----- the continuous population -------------------------------------------------------------------------

def _group(k, versions):
    turns = [Turn([1], [2] * len(v), [0.0] * len(v), "", ["a"], True, "o", 0.0, False, gen_versions=list(v),
                  policy_version=min(v)) for v in versions]
    return k, [Episode("bandit", "t", 0, group_id=f"c{k}", turns=turns)]


def test_admission_drops_a_group_whose_oldest_token_is_older_than_the_bound():
    """At step 3 with trainer.max_staleness=1: tokens of version 2 and 3 may be trained on, a group holding one
    token of version 1 is dropped whole and counted; the groups after the batch stay buffered, in order."""
    from agentrl.rollout.continuous import admit

    buffer = collections.deque([_group(0, [[3, 3]]), _group(1, [[1, 2], [3]]), _group(2, [[2, 3]]),
                                _group(3, [[0]]), _group(4, [[3]]), _group(5, [[2]])])
    admitted, dropped = admit(buffer, step=3, bound=1, want=3)
    assert [k for k, _ in admitted] == [0, 2, 4] and dropped == 2
    assert [k for k, _ in buffer] == [5]


def test_continuous_refuses_what_it_cannot_run_in_one_line():
    ok = load_config("grpo", env="sokoban", overrides=["rollout.mode=continuous", "trainer.max_staleness=2"])
    assert ok.rollout.mode == "continuous"
    bad = {
        "trainer.max_staleness >= 1": ["trainer.max_staleness=0"],
        "trainer.generator=embedded": ["trainer.max_staleness=1", "trainer.generator=remote",
                                       "trainer.generator_url=http://x:1"],
        "rollout.task_sampler=uniform": ["trainer.max_staleness=1", "rollout.task_sampler=learnability"],
    }
    for key, overrides in bad.items():
        with pytest.raises(ConfigError) as e:
            load_config("grpo", env="sokoban", overrides=["rollout.mode=continuous", *overrides])
        assert "\n" not in str(e.value) and key in str(e.value) and "rollout.mode=continuous" in str(e.value)
    for method in ("crps", "spear", "leafe", "rro", "rft", "sft"):
        with pytest.raises(ConfigError, match=rf"method={method} cannot take its groups .*: .*; use "):
            load_config(method, env="sokoban", overrides=["rollout.mode=continuous", "trainer.max_staleness=1"])


def test_a_user_generator_backend_plugs_in_by_import_path():
    from agentrl.generation.backends import GENERATORS

    assert {"embedded", "remote", "vllm"} <= set(GENERATORS.names())
    cfg = load_config("grpo", env="sokoban", overrides=["trainer.generator=agentrl.generation.backends:make_embedded"])
    assert GENERATORS.get(cfg.trainer.generator) is GENERATORS.get("embedded")
    with pytest.raises(ConfigError, match=r"bad value for 'trainer.generator': 'nope'; allowed: embedded, remote"):
        load_config("grpo", env="sokoban", overrides=["trainer.generator=nope"])


def _collector(tiny_model_dir, *extra, seed=0):
    import random

    from agentrl.envs.pool import InProcessEnvs
    from agentrl.generation.embedded import EmbeddedGenerator
    from agentrl.recipe import RECIPES
    from agentrl.rollout.continuous import ContinuousCollector
    from agentrl.rollout.sampler import RolloutSampler

    cfg = load_config("grpo", env="sokoban", overrides=[
        f"model.name={tiny_model_dir}", "rollout.mode=continuous", "trainer.max_staleness=1", "rollout.groups=2",
        "rollout.group_size=2", "rollout.slots=6", "rollout.max_turns=4", "rollout.max_new_tokens=12",
        "rollout.fill_groups=0",
        f"trainer.seed={seed}", *extra])
    gen = EmbeddedGenerator.from_folder(tiny_model_dir)
    envs = InProcessEnvs("sokoban", cfg.rollout.slots)
    sampler = RolloutSampler(cfg, gen, gen.tokenizer, envs, random.Random(0), lambda: 0)
    return ContinuousCollector(cfg, gen, sampler, RECIPES.get("grpo")(cfg)), gen, envs


def test_group_starts_depend_on_the_seed_and_the_group_only(tiny_model_dir):
    a, _, ea = _collector(tiny_model_dir)
    b, _, eb = _collector(tiny_model_dir)
    c, _, ec = _collector(tiny_model_dir, seed=1)
    try:
        assert [a.group_start(k) for k in range(8)] == [b.group_start(k) for k in range(8)]
        assert [a.group_start(k) for k in range(8)] != [c.group_start(k) for k in range(8)]
    finally:
        for e in (ea, eb, ec):
            e.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_token_says_the_version_that_drew_it_when_updates_land_mid_episode(tiny_model_dir, tmp_path):
    """Episodes run on while the learner's updates land: a turn drawn by one version has that version's
    log-probs (teacher-forced through its weights); in a turn an update landed in, the labels step up at
    the load and later tokens are not the old version's (the rows keep the KV cache of the older weights, so
    they are the new weights' over it: agentrl.generation.embedded)."""
    from agentrl.generation.embedded import EmbeddedGenerator
    from agentrl.learner.engine import TorchEngine

    col, gen, envs = _collector(tiny_model_dir)
    eng = TorchEngine(tiny_model_dir)
    models = {0: EmbeddedGenerator.from_folder(tiny_model_dir).model}
    episodes = []
    try:
        for step in range(3):
            got = col.take(step)
            episodes += got.episodes
            g = torch.Generator().manual_seed(step)
            with torch.no_grad():
                for p in eng.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            models[step + 1] = EmbeddedGenerator.from_folder(tiny_model_dir).model
            models[step + 1].load_state_dict(eng.model.state_dict())
            col.end_step(step, eng, tmp_path)
            assert max(step - t.policy_version for e in got.episodes for t in e.turns if t.gen_ids) <= 1
    finally:
        col.close()
        envs.close()
    turns = [t for e in episodes for t in e.turns if t.gen_ids]
    # episodes carried over an update: drawn by two versions (some turns too, where a load came mid-turn)
    assert any(len({v for t in e.turns for v in t.gen_versions}) > 1 for e in episodes)
    checked, mixed = _teacher_forced_check(turns, models)
    assert checked > 20
    print(f"{mixed} of {len(turns)} turns drawn by two versions")


def _teacher_forced_check(turns, models):
    """Every token drawn before a load in its turn has the log-prob the turn's first version gives it (the
    version's weights, teacher-forced; renormalized over the token's allowed ids where answers were
    constrained); in a turn an update landed in, the later tokens drawn among several ids are not that
    version's. Returns the tokens checked (those with a choice) and the turns drawn by two versions."""
    checked = mixed = 0
    for t in turns:
        assert len(t.gen_versions) == len(t.gen_ids) and t.policy_version == min(t.gen_versions)
        assert t.gen_versions == sorted(t.gen_versions)  # a version, once loaded, draws the rest
        ids = torch.tensor([t.prompt_ids + t.gen_ids])
        n = len(t.prompt_ids)
        first = t.gen_versions[0]
        with torch.no_grad():
            logits = models[first](ids).logits[0, n - 1:-1].float()
        allowed = t.gen_allowed or [[] for _ in t.gen_ids]
        got = torch.stack([logits[i, tok] - torch.logsumexp(logits[i, a or slice(None)], -1)
                           for i, (tok, a) in enumerate(zip(t.gen_ids, allowed))])
        rec = torch.tensor(t.gen_logprobs)
        same = torch.tensor([v == first for v in t.gen_versions])
        choice = torch.tensor([len(a) != 1 for a in allowed])  # a forced token's log-prob is 0 under any weights
        assert torch.allclose(got[same], rec[same], atol=1e-3)
        checked += int((same & choice).sum())
        if not same.all():
            mixed += 1
            later = ~same & choice
            assert not later.any() or (got[later] - rec[later]).abs().max() > 1e-3
    return checked, mixed


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lora_run_in_continuous_mode_samples_each_version_s_merged_adapters_mid_episode(tiny_model_dir, tmp_path):
    """model.lora_r with rollout.mode=continuous on the torch engine: the embedded generator is a plain copy fed
    the adapters merged (``copy_weights_to``) after every update, loaded mid-episode. Every token's version
    label is the version whose merged adapters give its log-prob, none is older than the bound, and after the
    run the generator holds exactly the merged weights of the last version it loaded."""
    from agentrl import Trainer
    from agentrl.generation.embedded import EmbeddedGenerator

    # each env step takes 0.5 s, so an episode (4 turns) outlasts an update of the tiny model, and with a bound
    # of 2 the population may run two steps' groups ahead: its slots are busy whenever an update lands
    cfg = load_config("grpo", env="latency:sokoban", overrides=small(
        tmp_path, tiny_model_dir, 'env_kwargs={"latency": "fixed", "latency_s": 0.5}', "model.lora_r=8",
        "optim.lr=3e-2", "rollout.mode=continuous",
        "trainer.max_staleness=2", "rollout.groups=2", "rollout.group_size=2", "rollout.slots=6",
        "rollout.max_turns=4", "rollout.max_new_tokens=12", "rollout.fill_groups=0", "trainer.steps=4",
        "eval.tasks=0", "trainer.checkpoint_every=10"))
    t = Trainer.from_config(cfg)
    assert t.engine.cfg.lora is not None and t.generator.model is not t.engine.model  # a copy, not the PEFT module

    def merged():
        return {k: v.detach().clone() for k, v in t.engine.merged_model().state_dict().items()}

    weights = {0: merged()}  # version -> the policy's weights, adapters merged
    trained = []
    learn = t.recipe.learn

    def recorded(trainer, episodes, collected):
        trained.extend((trainer.step, e) for e in episodes)
        out = learn(trainer, episodes, collected)
        weights[trainer.step + 1] = merged()  # what end_step stages as version step + 1
        return out

    t.recipe.learn = recorded
    try:
        t.train()
        held = {k: v.detach().clone() for k, v in t.generator.model.state_dict().items()}
        version, loads = t.generator.version, t.generator.inflight_loads
    finally:
        t.close()
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    assert all(r["staleness_token_max"] <= 2 and r["staleness_max"] <= 2 for r in got[1:])
    assert loads >= 2 and version >= 2  # updates were loaded while the population ran
    assert all(torch.equal(held[k], weights[version][k]) for k in held)  # the generator: that version's adapters
    assert any(not torch.allclose(weights[0][k], weights[version][k]) for k in held)  # the adapters trained
    for step, e in trained:  # labels within the bound of the step that trained them
        assert all(step - v <= 2 for turn in e.turns for v in turn.gen_versions)
    models = {}
    for v, w in weights.items():
        models[v] = EmbeddedGenerator.from_folder(tiny_model_dir).model
        models[v].load_state_dict(w)
    episodes = [e for _, e in trained]
    assert any(len({v for turn in e.turns for v in turn.gen_versions}) > 1 for e in episodes)  # updates mid-episode
    checked, mixed = _teacher_forced_check([turn for e in episodes for turn in e.turns if turn.gen_ids], models)
    assert checked > 20
    print(f"{mixed} turns drawn by two versions")


def _records_groups(run: Path) -> dict[int, list[str]]:
    from agentrl.runs.records import members, records_path

    out: dict[int, list[str]] = {}
    step = None
    for _, _, text in members(records_path(run, "train").read_bytes()):
        for line in text.decode().splitlines():
            r = json.loads(line)
            if "schema" in r:  # a step's header
                step = r["step"]
                out[step] = []
            elif step is not None and "group" in r:
                out[step].append(r["group"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_continuous_run_killed_with_sigkill_resumes_with_nothing_lost_or_trained_twice(tiny_model_dir, tmp_path):
    """A real `agentrl train` process killed with SIGKILL after its step-2 checkpoint: the same command resumes
    from it, every step is logged once, and no group is trained twice (the train records hold every group)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "grpo", "--env", "bandit", *small(
        out, tiny_model_dir, "rollout.mode=continuous", "trainer.max_staleness=1", "rollout.groups=2",
        "rollout.group_size=2", "rollout.slots=8", "trainer.steps=6", "trainer.record_groups=0")]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            done = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] \
                if (out / "metrics.jsonl").exists() else []
            if 3 in done:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout
    got = rows(out)
    assert [r["step"] for r in got] == list(range(7))
    groups = _records_groups(out)
    assert sorted(groups) == list(range(1, 7))
    every = [g for s in sorted(groups) for g in set(groups[s])]
    assert len(every) == len(set(every)) == 12


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher,lora", [("torchrun", False), ("torchrun", True),
                                           pytest.param("deepspeed", False, marks=pytest.mark.extended)])
def test_continuous_on_two_ranks_trains_every_rank_s_groups_once_and_resumes(tiny_model_dir, tmp_path, launcher,
                                                                            lora):
    """Two DeepSpeed ranks, a population each: a step trains both ranks' shares (groups numbered rank, rank + 2, ...),
    the same batch on every rank, no token older than the bound; a resumed run (both populations from the
    checkpoint) goes on with no group trained twice. LoRA: each rank's generator copy takes the gathered adapters
    merged (``merged_lora``) after every update, the same way."""
    from tests.test_multirank import launch

    out = tmp_path / "run"
    args = ["train", "grpo", "--env", "bandit", *small(
        out, tiny_model_dir, "trainer.engine=deepspeed", "rollout.mode=continuous", "trainer.max_staleness=1",
        "rollout.groups=2", "rollout.group_size=2", "rollout.slots=4", "trainer.record_groups=0", "eval.tasks=0",
        *(["model.lora_r=8"] if lora else []))]
    first = launch(2, [*args, "trainer.steps=3"], launcher=launcher)
    assert first.returncode == 0, first.stderr[-3000:]
    again = launch(2, [*args, "trainer.steps=5"], launcher=launcher)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    got = rows(out)
    assert [r["step"] for r in got] == list(range(6))
    assert all(r["staleness_token_max"] <= 1 for r in got if r["step"] > 0)
    groups = _records_groups(out)
    assert sorted(groups) == list(range(1, 6)) and all(len(set(g)) == 2 for g in groups.values())
    every = [g for s in sorted(groups) for g in set(groups[s])]
    assert len(every) == len(set(every)) == 10  # no group twice, before or after the resume
    numbers = {int(g.split(":")[0][1:]) for g in every}
    assert {k % 2 for k in numbers} == {0, 1}  # both ranks' populations trained
    if lora:  # every step updated the adapters, and the generator copies loaded the versions while sampling
        assert all("loss" in r for r in got[1:]) and sum(r.get("inflight_loads", 0) for r in got) >= 3
