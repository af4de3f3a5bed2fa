"""`agentrl bench async`: the rollout loop with a per-turn barrier (lockstep) vs per-trajectory (async).

The same starts, the same generator and the same sampling seeds in both modes, on an env whose steps take
a long-tailed random time (``latency:<env>``, ``envs/latency.py``); answers are constrained to the env's
admissible actions so that every turn steps the env. Lockstep refills slots as episodes end (its faster
variant); the process pool steps the slots of a lockstep turn in parallel, so lockstep waits for the slowest
step of each turn, not for their sum. Throughput is generated tokens over wall time, the median of
``--repeats`` alternating runs; ``same_episodes`` checks that both modes rolled out identical episodes.
Where vLLM is installed (``make vllm-setup``), the loop through a vLLM server is also compared with vLLM
alone on the same requests at the same concurrency (``loop_over_vllm``, with every repeat's pair; the plain
env, so env time does not count against the loop).
Then a GRPO training step with ``trainer.max_staleness`` 0, 1, 2 and 4 (``sync_step_s``, ``overlap_step_s``,
``staleness2_step_s``, ``staleness4_step_s``, each with its gain over synchronous), and at 1 and 2 with in-flight
weight updates (``inflight1_step_s``, ``inflight2_step_s``); ``*_token_staleness``: how many versions behind the
learner the trained tokens were, on average.
Then continuous rollouts (``rollout.mode: continuous``, ``trainer.max_staleness: 1``) against a lockstep on-policy
step and today's staleness-1 overlap (async loop, ``trainer.max_staleness: 1``), the same GRPO config
otherwise: ``lockstep_step_s``, ``staleness1_async_step_s``, ``continuous_step_s`` and the two gains
(``continuous_over_lockstep``, ``continuous_over_staleness1``), with the groups continuous mode dropped.
``--parts`` picks which of the four run (e.g. ``--parts vllm --model PATH`` on a GPU node). ``--latency none``
runs ``--env`` as it is, with no delay added: a real slow env (``--env scienceworld --latency none``, each slot
a JVM). ``--steps``: the timed steps of each training run (after its first).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


PARTS = ("loop", "vllm", "overlap", "continuous")
STALENESS = (1, 2, 4)  # the overlap's trainer.max_staleness values, each against 0
INFLIGHT = (1, 2)  # the same with trainer.inflight_updates


def _parts(text: str) -> str:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"{','.join(bad) or 'nothing'}: not among {', '.join(PARTS)}")
    return ",".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency", default="lognormal", choices=["fixed", "uniform", "lognormal", "pareto", "none"],
                   help="async: the env's step delay distribution (default lognormal); none: the env as it is, "
                   "no wrapper (a real slow env: --env scienceworld --latency none)")
    p.add_argument("--latency-s", type=float, default=0.05, help="async: median (scale) step delay, s")
    p.add_argument("--latency-sigma", type=float, default=1.5, help="async: lognormal shape (tail weight)")
    p.add_argument("--episodes", type=int, default=0, help="async: episodes per run (default 2 x slots)")
    p.add_argument("--pool", default="", choices=["", "inprocess", "process"],
                   help="async: env slots (default process: slots step in parallel, as in training runs; "
                   "in-process slots step one after another, which lockstep mode pays for every turn)")
    p.add_argument("--quick", action="store_true",
                   help="async: a seconds-long smoke run (4 slots, 2 turns); trl: 1 round, 1 timed step, 2 x 2")
    p.add_argument("--parts", type=_parts, default=",".join(PARTS),
                   help="async: which comparisons to run, comma-separated: loop (lockstep vs async), vllm "
                   "(the loop through vLLM vs vLLM alone), overlap (staleness 0 vs 1, 2, 4, and 1, 2 with in-flight "
                   "weight updates), continuous (continuous rollouts vs lockstep and the staleness-1 overlap); "
                   "default all")
    p.add_argument("--overlap-generator", default="embedded", choices=["embedded", "vllm"],
                   help="async: the overlap's and the continuous runs' generator: the in-process copy, or a vLLM "
                   "server in its own process started per run on --port")


def _signature(episodes: list[Any]) -> list[Any]:
    return [(ep.task_id, ep.seed, [(t.prompt_ids, t.gen_ids, t.actions, t.reward, t.done) for t in ep.turns])
            for ep in episodes]


def _timed(engine: Any, starts: list[Any]) -> tuple[float, float, list[Any]]:
    t = time.perf_counter()
    episodes = engine.run(starts)
    s = time.perf_counter() - t
    return engine.stats["generated_tokens"] / s, s, episodes


def compare(gen: Any, tok: Any, make_envs: Any, env_name: str, starts: list[Any], turns: int, max_new: int,
            repeats: int) -> dict[str, Any]:
    """Median tok/s of lockstep and async over ``repeats`` alternating runs of ``starts``."""
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine
    from agentrl.types import SamplingParams

    spec_tag = None
    rates: dict[str, list[float]] = {"lockstep": [], "async": []}
    secs: dict[str, list[float]] = {"lockstep": [], "async": []}
    sigs: dict[str, list[Any]] = {}
    envs = make_envs()
    try:
        spec_tag = envs.call(0, "prompt_spec").answer_tag
        sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0, stop=[f"</{spec_tag}>"])
        for _ in range(repeats):
            for mode in ("lockstep", "async"):
                cfg = RolloutConfig(max_turns=turns, sampling=sampling, constrain_actions=True, refill=True,
                                    mode=mode)
                rate, s, eps = _timed(RolloutEngine(gen, tok, envs, env_name, cfg), starts)
                rates[mode].append(rate)
                secs[mode].append(s)
                sigs.setdefault(mode, _signature(eps))
    finally:
        envs.close()
    lock, asy = statistics.median(rates["lockstep"]), statistics.median(rates["async"])
    return dict(lockstep_tok_s=lock, async_tok_s=asy, speedup=asy / lock,
                lockstep_s=statistics.median(secs["lockstep"]), async_s=statistics.median(secs["async"]),
                same_episodes=sigs["lockstep"] == sigs["async"])


def vllm_figures(model_dir: Path, tok: Any, env: str, starts: list[Any], slots: int, turns: int, max_new: int,
                 port: int, repeats: int) -> dict[str, Any]:
    """The async loop through a vLLM server (``slots`` env slots, ``starts`` refilled into them) against vLLM
    alone on the very requests the loop sent (each prompt with its row's seed, so both decode the same
    tokens), all submitted at once with as many in flight as the loop has slots. After an untimed warm-up of
    the loop, each repeat times both, in alternating order, each from an empty prefix cache (as after a
    weight sync); the ratio is the median of the repeats' own ratios, since the server's speed drifts
    between repeats more than within one."""
    from concurrent.futures import ThreadPoolExecutor

    from agentrl.envs.pool import InProcessEnvs
    from agentrl.generation.vllm import VLLMServer
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, row_seed
    from agentrl.seeds import mix_seed
    from agentrl.types import SamplingParams

    srv = VLLMServer(model_dir, port=port, sync="shm")  # the trainer's setting; its dev routes reset the cache
    client = srv.start()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0)
    streams = [mix_seed(0, i) for i in range(len(starts))]
    pairs: list[tuple[float, float]] = []
    try:
        envs = InProcessEnvs(env, slots)
        try:
            def loop() -> tuple[float, list[Any]]:
                engine = RolloutEngine(client, tok, envs, env, RolloutConfig(max_turns=turns, sampling=sampling,
                                                                             mode="async", refill=True))
                t = time.perf_counter()
                eps = engine.run(starts, streams)
                return engine.stats["generated_tokens"] / (time.perf_counter() - t), eps

            _, eps = loop()  # warm-up; its requests are what vLLM alone is sent
            requests = [(t.prompt_ids, row_seed(stream, k)) for ep, stream in zip(eps, streams)
                        for k, t in enumerate(ep.turns)]

            def alone() -> float:
                t = time.perf_counter()
                with ThreadPoolExecutor(slots) as pool:
                    outs = list(pool.map(lambda r: client.generate([r[0]], sampling, seeds=[r[1]])[0], requests))
                return sum(len(c.ids) for c in outs) / (time.perf_counter() - t)

            for k in range(repeats):
                rates = {}
                for mode in (("loop", "alone") if k % 2 == 0 else ("alone", "loop")):
                    client.reset_prefix_cache()
                    rates[mode] = loop()[0] if mode == "loop" else alone()
                pairs.append((rates["loop"], rates["alone"]))
        finally:
            envs.close()
    finally:
        srv.stop()
    ratios = [a / b for a, b in pairs]
    return dict(vllm_slots=slots, vllm_episodes=len(starts), vllm_requests=len(requests),
                vllm_loop_tok_s=statistics.median(a for a, _ in pairs),
                vllm_alone_tok_s=statistics.median(b for _, b in pairs),
                loop_over_vllm=statistics.median(ratios), loop_over_vllm_min=min(ratios),
                loop_over_vllm_max=max(ratios), vllm_pairs=[[round(a), round(b)] for a, b in pairs])


def overlap_figures(model: str, env: str, kwargs: dict[str, Any], pool: str, slots: int, turns: int, max_new: int,
                    steps: int, repeats: int, staleness: tuple[int, ...] = STALENESS,
                    inflight: tuple[int, ...] = INFLIGHT, generator: str = "embedded",
                    port: int = 18690) -> dict[str, Any]:
    """A training step's wall time with ``trainer.max_staleness`` 0 (collect, then learn) and N in
    ``staleness`` (the next N steps' collects while this one learns), and N in ``inflight`` with in-flight weight
    updates (each update's weights loaded mid-collect): GRPO on the same config otherwise,
    ``steps`` steps a run, the median over the steps after the first (whose collect nothing overlaps) and
    over ``repeats`` alternating runs. Every step updates (entropy bonus, no group filtered), so each has
    learning to overlap."""
    import tempfile

    server = [f"trainer.generator={generator}", "trainer.vllm_servers=1", f"trainer.vllm_port={port}"] \
        if generator == "vllm" else []
    runs = [(0, False), *((n, False) for n in staleness), *((n, True) for n in inflight)]
    times: dict[tuple[int, bool], list[float]] = {r: [] for r in runs}
    learn: list[float] = []  # the on-policy steps' update time: what the overlap can hide at most
    waits: dict[tuple[int, bool], list[float]] = {r: [] for r in runs}  # the learner's wait for its collect
    behind: dict[tuple[int, bool], list[float]] = {r: [] for r in runs}  # versions behind, per token
    for _ in range(repeats):
        for n, flying in runs:
            with tempfile.TemporaryDirectory(prefix="agentrl-bench-overlap-") as out:
                got = [r for r in _grpo_steps(model, env, kwargs, pool, slots, turns, max_new, steps, out, [
                    f"trainer.max_staleness={n}", f"trainer.inflight_updates={str(flying).lower()}",
                    "rollout.mode=async", *server]) if r.get("step", 0) > 1]
                times[n, flying] += [r["time_step_s"] for r in got]
                learn += [r.get("time_learn_s", 0.0) for r in got] if n == 0 else []
                waits[n, flying] += [r.get("time_wait_collect_s", 0.0) for r in got]
                behind[n, flying] += [r.get("staleness_token_mean", r.get("staleness_mean", 0.0)) for r in got]
    sync, overlap = statistics.median(times[0, False]), statistics.median(times[1, False])
    fig = dict(overlap_generator=generator, overlap_steps=steps, sync_step_s=sync,
               sync_learn_s=statistics.median(learn), overlap_step_s=overlap, overlap_speedup=sync / overlap,
               overlap_wait_collect_s=statistics.median(waits[1, False]))
    for n, flying in runs[1:]:
        name = f"inflight{n}" if flying else ("overlap" if n == 1 else f"staleness{n}")
        if name != "overlap":  # staleness 1's step figures are the overlap_* above (their names of before)
            fig.update({f"{name}_step_s": statistics.median(times[n, flying]),
                        f"{name}_speedup": sync / statistics.median(times[n, flying]),
                        f"{name}_wait_collect_s": statistics.median(waits[n, flying])})
        fig[f"{name}_token_staleness"] = statistics.mean(behind[n, flying])
    return fig


def _grpo_steps(model: str, env: str, kwargs: dict[str, Any], pool: str, slots: int, turns: int, max_new: int,
                steps: int, out: str, extra: list[str], groups: int = 0) -> list[dict[str, Any]]:
    """One GRPO run of ``steps`` steps (every step updates: entropy bonus, no group filtered), ``groups``
    groups of 4 a step (default a quarter of the slots); its metrics."""
    from agentrl.config_loader import load_config
    from agentrl.metrics import read_metrics
    from agentrl.trainer import Trainer

    cfg = load_config("grpo", env=env, overrides=[
        f"model.name={model}", f"trainer.out_dir={out}", f"trainer.steps={steps}",
        f"trainer.checkpoint_every={steps + 1}", "trainer.progress=false", "trainer.tensorboard=false",
        "sft.enabled=false", "eval.tasks=0",
        f"rollout.groups={groups or max(1, slots // 4)}", "rollout.group_size=4", f"rollout.slots={slots}",
        f"rollout.max_turns={turns}", f"rollout.max_new_tokens={max_new}", f"rollout.pool={pool}",
        "rollout.constrain_actions=true", "algo.filters=[dropped]",
        "algo.entropy_coef=0.01", f"env_kwargs={json.dumps(kwargs)}", *extra])
    trainer = Trainer.from_config(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_metrics(Path(out))


CONTINUOUS_RUNS = {  # name -> overrides, each the same GRPO run otherwise
    "lockstep": ["rollout.mode=lockstep", "rollout.refill=true", "trainer.max_staleness=0"],
    "staleness1_async": ["rollout.mode=async", "trainer.max_staleness=1"],
    "continuous": ["rollout.mode=continuous", "trainer.max_staleness=1"],
}


def continuous_figures(model: str, env: str, kwargs: dict[str, Any], pool: str, slots: int, turns: int,
                       max_new: int, steps: int, repeats: int, generator: str = "embedded",
                       port: int = 18690) -> dict[str, Any]:
    """A training step's wall time with continuous rollouts against a lockstep on-policy step and the
    staleness-1 overlap of per-trajectory collects: the median over the steps after the first (whose rollouts
    nothing overlaps) and over ``repeats`` alternating runs. Every run has ``slots`` env slots and trains 16
    episodes a step (4 groups of 4; fewer when there are fewer slots): lockstep and the overlap roll out a
    step's episodes, the continuous population keeps every slot busy. ``generator`` vllm: each run starts a
    vLLM server of its own on ``port`` (the same one for every run)."""
    import tempfile

    server = [f"trainer.generator={generator}", "trainer.vllm_servers=1", f"trainer.vllm_port={port}"] \
        if generator == "vllm" else []
    times: dict[str, list[float]] = {k: [] for k in CONTINUOUS_RUNS}
    dropped: list[float] = []
    behind: list[float] = []
    for _ in range(repeats):
        for name, extra in CONTINUOUS_RUNS.items():
            with tempfile.TemporaryDirectory(prefix="agentrl-bench-continuous-") as out:
                got = [r for r in _grpo_steps(model, env, kwargs, pool, slots, turns, max_new, steps, out,
                                              ["rollout.fill_groups=0", *extra, *server],
                                              groups=max(1, min(slots, 16) // 4))
                       if r.get("step", 0) > 1]
            times[name] += [r["time_step_s"] for r in got]
            if name == "continuous":
                dropped += [r.get("continuous_dropped_groups", 0.0) for r in got]
                behind += [r.get("staleness_token_mean", 0.0) for r in got]
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(continuous_generator=generator, continuous_steps=steps, continuous_slots=slots,
                lockstep_step_s=med["lockstep"],
                staleness1_async_step_s=med["staleness1_async"], continuous_step_s=med["continuous"],
                continuous_over_lockstep=med["lockstep"] / med["continuous"],
                continuous_over_staleness1=med["staleness1_async"] / med["continuous"],
                continuous_dropped_groups=sum(dropped), continuous_token_staleness=statistics.mean(behind))


def run(args: argparse.Namespace) -> int:
    import torch

    from agentrl.envs import make
    from agentrl.envs.pool import EnvPool, InProcessEnvs
    from agentrl.generation.embedded import EmbeddedGenerator
    from agentrl.generation.vllm import vllm_python
    from agentrl.learner.models import load_tokenizer
    from agentrl.model_zoo import resolve_model
    from agentrl.rollout.engine import Start
    from agentrl.types import SamplingParams

    slots, turns, repeats = args.slots or 32, args.turns, args.repeats or 5
    latency_s, max_new = args.latency_s, args.max_new_tokens
    pool = args.pool or ("inprocess" if args.quick else "process")
    if args.quick:
        slots, turns, repeats, latency_s, max_new = 4, 2, 1, min(latency_s, 0.01), min(max_new, 16)
    n = args.episodes or 2 * slots
    if args.latency == "none":  # the env's own step times (ScienceWorld's JVM)
        env_name, kwargs = args.env, {}
    else:
        env_name = f"latency:{args.env}"
        kwargs = dict(latency=args.latency, latency_s=latency_s, latency_sigma=args.latency_sigma)
    # --steps: timed steps a training run, after its first (whose collect nothing overlaps)
    overlap_steps = 2 if args.quick else (args.steps + 1 if args.steps else 4)
    continuous_steps = 2 if args.quick else (args.steps + 1 if args.steps else 6)
    model_dir = resolve_model(args.model)
    parts = args.parts.split(",")
    tasks = make(args.env).tasks("train")
    starts = [Start(tasks[(i // 2) % len(tasks)].task_id, i, f"g{i // 2}") for i in range(n)]

    def make_envs() -> Any:
        cls = EnvPool if pool == "process" else InProcessEnvs
        return cls(env_name, slots, kwargs)

    fig: dict[str, Any] = dict(model=args.model, env=env_name, latency=args.latency, latency_s=latency_s,
                               latency_sigma=args.latency_sigma, slots=slots, episodes=n, turns=turns,
                               max_new_tokens=max_new, repeats=repeats, pool=pool,
                               threads=torch.get_num_threads())
    if args.latency == "none":  # no delay drawn: its parameters would only mislead
        del fig["latency_s"], fig["latency_sigma"]
    tok = load_tokenizer(model_dir)  # not the embedded model's: `--parts vllm` loads no weights here
    if "loop" in parts:
        gen = EmbeddedGenerator.from_folder(model_dir)
        gen.generate([[gen.tokenizer.eos_token_id] * 8], SamplingParams(max_new_tokens=4))  # warm-up
        fig.update(compare(gen, gen.tokenizer, make_envs, env_name, starts, turns, max_new, repeats))
    if "vllm" in parts and vllm_python() is None:
        fig["vllm"] = "skipped: vLLM is not installed (make vllm-setup on CPU, pip install vllm on a GPU node)"
    elif "vllm" in parts and args.quick:
        fig["vllm"] = "skipped: --quick (a vLLM server takes minutes to start)"
    elif "vllm" in parts:
        fig.update(vllm_figures(model_dir, tok, args.env, starts, slots, turns, max_new, args.port, repeats))
    if "overlap" in parts and args.overlap_generator == "vllm" and vllm_python() is None:
        fig["overlap"] = "skipped: --overlap-generator vllm and vLLM is not installed"
    elif "overlap" in parts:
        fig.update(overlap_figures(str(model_dir), env_name, kwargs, pool, min(slots, 16), turns, max_new,
                                   overlap_steps, repeats, STALENESS[:2] if args.quick else STALENESS,
                                   INFLIGHT[:1] if args.quick else INFLIGHT, args.overlap_generator, args.port))
    if "continuous" in parts and args.overlap_generator == "vllm" and vllm_python() is None:
        fig["continuous"] = "skipped: --overlap-generator vllm and vLLM is not installed"
    elif "continuous" in parts:
        fig.update(continuous_figures(str(model_dir), env_name, kwargs, pool, slots, turns, max_new,
                                      continuous_steps, repeats, args.overlap_generator, args.port))
    line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in fig.items()})
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0
