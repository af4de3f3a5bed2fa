"""Env pools side by side (JSON): start-up, memory per worker, one step's latency, steps per second.

    python -m agentrl.envs.ray_bench --env alfworld --slots 1 8 --steps 40 --pools inprocess process ray

Each pool is started with ``n`` slots, every slot reset to its own task, then stepped ``--steps`` times in
batch with admissible actions (a slot whose episode ends is reset, not counted). ``step_ms`` is the mean
latency of a one-slot step (n=1); ``overhead_ms`` is that minus the in-process step, i.e. what the
pool's messaging costs, and ``overhead_ratio`` puts it next to the env's own step.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import psutil

from agentrl.envs.registry import make_pool


def _rss_mib(pids: set[int]) -> float:
    """Mean resident memory of a worker process and its children (ScienceWorld's JVM), MiB (0 when the
    envs live in this process)."""
    rss = []
    for p in pids:
        proc = psutil.Process(p)
        rss.append(sum(q.memory_info().rss for q in [proc, *proc.children(recursive=True)]))
    return round(sum(rss) / len(rss) / 2 ** 20, 1) if rss else 0.0


def _pids(pool: Any) -> set[int]:
    return {pool.pid(i) for i in range(len(pool))} if callable(getattr(pool, "pid", None)) else set()


def _action(info: dict[str, Any], k: int) -> str:
    acts = info.get("admissible_actions") or ["look"]
    return acts[(7 * k + 3) % len(acts)]  # a fixed walk through the admissible actions, the same on each pool


def bench_pool(kind: str, env: str, n: int, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    pool = make_pool(kind, env, n, None, **options)
    start_s = time.perf_counter() - t0
    try:
        tasks = [t.task_id for t in pool.call(0, "tasks", "train")]
        infos = {i: r.info for i, r in pool.reset({i: (tasks[i % len(tasks)], i) for i in range(n)}).items()}
        done_steps, resets, wall = 0, n, 0.0
        for k in range(steps):
            t0 = time.perf_counter()
            out = pool.step({i: _action(infos[i], k) for i in range(n)})
            wall += time.perf_counter() - t0  # steps only: the resets between episodes are not timed
            done_steps += len(out)
            ended = [i for i, r in out.items() if r.done]
            infos.update({i: r.info for i, r in out.items()})
            if ended:
                infos.update({i: r.info for i, r in pool.reset(
                    {i: (tasks[(resets + j) % len(tasks)], resets + j) for j, i in enumerate(ended)}).items()})
                resets += len(ended)
        return {"pool": kind, "slots": n, "start_s": round(start_s, 3), "rss_mib_per_worker": _rss_mib(_pids(pool)),
                "steps_per_s": round(done_steps / wall, 1), "step_ms": round(1000 * wall / steps, 2)}
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="sokoban")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pools", nargs="+", default=["inprocess", "process", "ray"])
    ap.add_argument("--ray-slots-per-actor", type=int, default=1)
    ap.add_argument("--ray-num-cpus", type=float, default=1.0)
    ap.add_argument("--ray-address", default="")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"env": args.env, "steps": args.steps, "rows": []}
    started = False
    if "ray" in args.pools:  # one Ray instance for every ray row; its start is reported once
        from agentrl.envs.ray_connect import connect, disconnect

        t0 = time.perf_counter()
        started = connect(args.ray_address, max(args.slots) * args.ray_num_cpus)
        out["ray_connect_s"] = round(time.perf_counter() - t0, 2)
    try:
        for n in args.slots:
            for kind in args.pools:
                opts = dict(slots_per_actor=args.ray_slots_per_actor, num_cpus=args.ray_num_cpus) \
                    if kind == "ray" else {}
                out["rows"].append(bench_pool(kind, args.env, n, args.steps, opts))
                print(json.dumps(out["rows"][-1]), flush=True)
    finally:
        if started:
            disconnect(started)
    one = {r["pool"]: r["step_ms"] for r in out["rows"] if r["slots"] == 1}
    if "inprocess" in one:
        for kind in ("process", "ray"):
            if kind in one:
                over = one[kind] - one["inprocess"]
                out[f"{kind}_overhead_ms"] = round(over, 2)
                out[f"{kind}_overhead_ratio"] = round(over / one["inprocess"], 3) if one["inprocess"] else None
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
