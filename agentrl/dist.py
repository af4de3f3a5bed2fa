"""Ranks for the training loop: who am I, how many are we, and the few collectives the trainer needs.

Every function works in one process without ``torch.distributed`` (world 1, rank 0, gathers return
``[obj]``), so the trainer and recipes never branch on whether they run under a launcher. Under
``torchrun`` or ``deepspeed`` the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) is read once by ``init``.

A thread may send its collectives to a group of its own (``side_group``, ``collectives_on``): the overlap's
producer gathers its rollouts there while the learner's thread runs the engine's collectives on the default
group, so the two streams of collectives never interleave.
"""
from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Sequence

import torch


def launched_world() -> int:
    """World size the launcher asked for (1 when not launched by torchrun/deepspeed)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def _pg() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if _pg():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0) if launched_world() > 1 else 0


def world() -> int:
    if _pg():
        import torch.distributed as dist

        return dist.get_world_size()
    return 1


def is_main() -> bool:
    return rank() == 0


def resolve_device(spec: str) -> str:
    """``auto``: this rank's CUDA device when CUDA is present, else CPU; ``cpu``; ``cuda`` (errors without one)."""
    if spec == "cpu":
        return "cpu"
    if spec not in ("auto", "cuda") and not spec.startswith("cuda:"):
        raise ValueError(f"trainer.device must be auto, cpu or cuda, got {spec!r}")
    if torch.cuda.is_available():
        return spec if spec.startswith("cuda:") else f"cuda:{local_rank() % torch.cuda.device_count()}"
    if spec == "auto":
        return "cpu"
    raise ValueError(f"trainer.device={spec} but no CUDA device is visible; use trainer.device=cpu or auto")


def init(device: str, timeout_s: float = 1800.0) -> int:
    """Join the launcher's process group (NCCL on CUDA, gloo on CPU) when WORLD_SIZE > 1; returns the
    world size. A no-op in one process or when a group already exists."""
    import torch.distributed as dist

    if launched_world() <= 1 or _pg():
        return world()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return world()


_scope = threading.local()  # the group this thread's collectives go to (None: the default group)


def _group() -> Any:
    return getattr(_scope, "group", None)


def side_group() -> Any:
    """A second group of every rank for Python objects (gloo, also beside NCCL), or None in one process.
    Collective: every rank calls it, in the same order."""
    if not _pg():
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


@contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """This thread's collectives (the functions below) go to ``group`` while the block runs."""
    before, _scope.group = _group(), group
    try:
        yield
    finally:
        _scope.group = before


def barrier() -> None:
    if _pg():
        import torch.distributed as dist

        dist.barrier(group=_group())


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not _pg():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_group())
    return out


class RankFailed(RuntimeError):
    """Another rank's error, raised on every rank of a collective call it failed before, so none waits."""


def all_gather_ordered(n: int, mine: Sequence[int], local: Sequence[Any], extra: Any = None,
                       error: BaseException | None = None) -> tuple[list[Any], list[Any]]:
    """Each rank holds ``local[k]`` for the global index ``mine[k]`` of ``n``: every rank gets all ``n`` items
    in order, and every rank's ``extra`` in rank order (one collective). A rank that failed making its
    share passes its ``error`` instead: it is raised there and a ``RankFailed`` naming it on every other
    rank, where the gather would otherwise have left them waiting."""
    items: list[Any] = [None] * n
    extras = []
    failed = []
    why = None if error is None else f"{type(error).__name__}: {error}"
    for rank, (idx, part, ex, err) in enumerate(all_gather_object((list(mine), list(local), extra, why))):
        if err is not None:
            failed.append(f"rank {rank}: {err}")
        for i, x in zip(idx, part):
            items[i] = x
        extras.append(ex)
    if error is not None:
        raise error
    if failed:
        raise RankFailed("; ".join(failed))
    return items, extras


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank."""
    if not _pg():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_group())  # src: a global rank (every group has them all)
    return box[0]


def shard_groups(group_ids: Sequence[str], n_ranks: int) -> list[list[int]]:
    """Indices of ``group_ids`` per rank: whole groups only (a group is never split), groups dealt in
    order of first appearance to the rank with the fewest rows so far (ties to the lowest rank), so the
    split depends only on the list, never on timing."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        if g not in members:
            members[g] = []
            order.append(g)
        members[g].append(i)
    shards: list[list[int]] = [[] for _ in range(n_ranks)]
    for g in order:
        r = min(range(n_ranks), key=lambda k: (len(shards[k]), k))
        shards[r] += members[g]
    return [sorted(s) for s in shards]
