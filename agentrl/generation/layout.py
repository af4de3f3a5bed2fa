"""Where the learner ranks and the vLLM servers run, per node and GPU, and the layouts that cannot work.

One job: turn the config and a machine shape (nodes x GPUs per node) into a placement, as plain data. The
trainer refuses a server on a learner GPU with it before anything starts (``server_gpu_conflict``); the
launch plan (``agentrl train --dry-run``, ``agentrl.commands.plan``) prints it with the memory estimates.

Placement rules, as the trainer runs them: rank 0 starts ``trainer.vllm_servers`` servers on its own node
(node 0), server k on the GPUs ``trainer.vllm_gpus[k]`` names (e.g. ``"6"`` or ``"4,5"`` for
``vllm.tensor_parallel_size=2``); the learner ranks take every other GPU of every node, or every GPU when
the servers are colocated (``vllm.colocate``) on them.

The launched ranks decide on their own node only: a rank on another node than rank 0 never compares its
GPUs with the servers' (they are node 0's). ``AGENTRL_REHEARSE_GPUS=N`` shows the placement code N GPUs
per node on a machine without them (``scripts/rehearse.sh``): the conflict checks and each server's GPUs
are decided as on that node, while the ranks and servers still run where they run (the CPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Placement:
    nodes: int
    gpus_per_node: int
    learner: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, gpu) -> learner rank
    servers: list[list[tuple[int, int]]] = field(default_factory=list)  # server k -> its (node, gpu)s
    errors: list[str] = field(default_factory=list)

    @property
    def learner_ranks(self) -> int:
        return len(self.learner)


def gpu_list(entry: Any) -> list[int]:
    """``6``, ``"6"``, ``"4,5"`` -> GPU indices; raises ValueError on anything else."""
    return [int(x) for x in str(entry).replace(" ", "").split(",") if x != ""]


def place(tcfg: Any, vcfg: Any, nodes: int, gpus_per_node: int) -> Placement:
    """The placement of a run of ``tcfg``/``vcfg`` on ``nodes`` x ``gpus_per_node`` GPUs, with one
    ``error:``-ready sentence per thing that cannot work."""
    p = Placement(nodes, gpus_per_node)
    tp = vcfg.tensor_parallel_size
    n_servers = tcfg.vllm_servers if tcfg.generator == "vllm" and not tcfg.generator_url else 0
    if tp < 1:
        p.errors.append(f"vllm.tensor_parallel_size={tp}: must be 1 or more")
        tp = 1
    taken: dict[tuple[int, int], int] = {}
    for k in range(n_servers):
        if k < len(tcfg.vllm_gpus):
            try:
                gpus = gpu_list(tcfg.vllm_gpus[k])
            except ValueError:
                p.errors.append(f"trainer.vllm_gpus[{k}]={tcfg.vllm_gpus[k]!r} is not a GPU list like 6 or '4,5'")
                continue
        elif vcfg.colocate:
            gpus = colocated_gpus(k, tp, list(range(gpus_per_node)))
        else:
            p.errors.append(f"vLLM server {k} has no GPU of its own (trainer.vllm_gpus has "
                            f"{len(tcfg.vllm_gpus)} entries for trainer.vllm_servers={n_servers}) and would share "
                            "learner GPU 0: list its GPUs in trainer.vllm_gpus or set vllm.colocate=true")
            continue
        if len(gpus) != tp:
            p.errors.append(f"vLLM server {k} has {len(gpus)} GPU(s) ({','.join(map(str, gpus))}) but "
                            f"vllm.tensor_parallel_size={tp}: give each server exactly {tp} in trainer.vllm_gpus")
        bad = [g for g in gpus if not 0 <= g < gpus_per_node]
        if bad:
            p.errors.append(f"vLLM server {k} names GPU {bad[0]}, but a node has GPUs 0-{gpus_per_node - 1}")
            continue
        for g in gpus:
            if (0, g) in taken and not vcfg.colocate:
                p.errors.append(f"vLLM servers {taken[(0, g)]} and {k} both name GPU {g} in trainer.vllm_gpus")
            taken[(0, g)] = k
        p.servers.append([(0, g) for g in gpus])
    rank = 0
    for node in range(nodes):
        for g in range(gpus_per_node):
            if vcfg.colocate or (node, g) not in taken:
                p.learner[(node, g)] = rank
                rank += 1
    if not p.learner:
        p.errors.append(f"no GPU is left for the learner: the servers take all {gpus_per_node} of node 0 "
                        "and there is no other node")
    if vcfg.colocate and n_servers and not 0 < vcfg.gpu_memory_utilization < 1:
        p.errors.append("vllm.colocate=true needs vllm.gpu_memory_utilization, the share of each GPU a server "
                        "takes (e.g. 0.3), below 1: the rest is the learner's")
    if vcfg.colocate and tcfg.vllm_sync == "nccl":
        p.errors.append("trainer.vllm_sync=nccl cannot reach servers on the learner's GPUs (vllm.colocate=true): "
                        "NCCL refuses two ranks on one GPU; use trainer.vllm_sync=auto (CUDA IPC)")
    return p


def colocated_gpus(k: int, tp: int, learner_gpus: list[int]) -> list[int]:
    """Colocated server ``k``'s GPUs without a ``trainer.vllm_gpus`` entry: learner ranks k*tp .. k*tp+tp-1's."""
    return [learner_gpus[(k * tp + i) % len(learner_gpus)] for i in range(tp)]


def rehearsal_gpus() -> int:
    """``AGENTRL_REHEARSE_GPUS``: the GPUs per node the placement code is shown (0: the real ones)."""
    raw = os.environ.get("AGENTRL_REHEARSE_GPUS", "").strip()
    return int(raw) if raw.isdigit() else 0


def places_gpus(device: str) -> bool:
    """Whether GPU placement applies: a CUDA device, or a rehearsal of one (``AGENTRL_REHEARSE_GPUS``)."""
    return device.startswith("cuda") or rehearsal_gpus() > 0


def node_rank() -> int:
    """This process's node as the launcher numbers it (rank 0's node is 0): torchrun's GROUP_RANK, the
    DeepSpeed launcher's CROSS_RANK, NODE_RANK; else 0 when this rank is among the first LOCAL_WORLD
    ranks (both launchers number the ranks node by node), else 1."""
    for key in ("GROUP_RANK", "CROSS_RANK", "NODE_RANK"):
        raw = os.environ.get(key, "").strip()
        if raw.isdigit():
            return int(raw)
    rank = int(os.environ.get("RANK", "0") or 0)
    return 0 if rank == int(os.environ.get("LOCAL_RANK", "0") or 0) else 1


def local_world(world: int) -> int:
    """The ranks on this node: torchrun's LOCAL_WORLD_SIZE, the DeepSpeed launcher's LOCAL_SIZE, else ``world``."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        raw = os.environ.get(key, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return world


def learner_gpus_here(local_world: int) -> list[int]:
    """This node's learner GPUs as physical indices: the first ``local_world`` of CUDA_VISIBLE_DEVICES
    (the launcher's), else 0..local_world-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [int(x) for x in visible.split(",") if x.strip().isdigit()] if visible else []
    return ids[:local_world] if ids else list(range(local_world))


def server_gpus(tcfg: Any, vcfg: Any, k: int, world: int) -> str:
    """CUDA_VISIBLE_DEVICES of server ``k`` as rank 0 starts it: its ``trainer.vllm_gpus`` entry, else, when
    colocated, the GPUs of learner ranks k*tp.. on this node (the plan's server k on GPU k); "" otherwise."""
    if k < len(tcfg.vllm_gpus):
        return str(tcfg.vllm_gpus[k]).replace(" ", "")
    if vcfg.colocate:
        here = learner_gpus_here(max(1, local_world(world)))
        return ",".join(map(str, colocated_gpus(k, max(1, vcfg.tensor_parallel_size), here)))
    return ""


def server_gpu_conflict(tcfg: Any, vcfg: Any, device: str, world: int) -> str:
    """One line when a server the trainer would start shares a learner GPU without ``vllm.colocate`` (vLLM
    reserves 0.92 of its GPU by default and NCCL refuses two ranks on one GPU), or has another number of
    GPUs than ``vllm.tensor_parallel_size``; empty when the layout can run. The servers are on rank 0's node:
    the GPU overlap is decided there (a rank of node 1 has GPUs 4-7 of its own, not the servers'); the
    config checks are the same on every rank."""
    if not places_gpus(device) or vcfg.colocate:
        return ""
    on_servers_node = node_rank() == 0
    learner = set(learner_gpus_here(max(1, local_world(world)))) if on_servers_node else set()
    for k in range(tcfg.vllm_servers):
        if k >= len(tcfg.vllm_gpus):
            return (f"vLLM server {k} has no GPU of its own (trainer.vllm_gpus has {len(tcfg.vllm_gpus)} entries) "
                    "and would share the learner's GPU: list its GPUs in trainer.vllm_gpus (e.g. [6, 7]) and "
                    "launch the ranks on the others, or set vllm.colocate=true with vllm.gpu_memory_utilization")
        gpus = gpu_list(tcfg.vllm_gpus[k])
        if len(gpus) != vcfg.tensor_parallel_size:
            return (f"vLLM server {k} has {len(gpus)} GPU(s) in trainer.vllm_gpus but "
                    f"vllm.tensor_parallel_size={vcfg.tensor_parallel_size}")
        if rehearsal_gpus() and (bad := [g for g in gpus if g >= rehearsal_gpus()]):
            return f"vLLM server {k} names GPU {bad[0]}, but a node has GPUs 0-{rehearsal_gpus() - 1}"
        shared = sorted(learner & set(gpus))
        if shared:
            return (f"vLLM server {k} would run on GPU {shared[0]}, a learner rank's GPU on node 0 (where rank 0 "
                    "starts the servers): launch node 0's ranks on the other GPUs (deepspeed --include "
                    "node0:..., or CUDA_VISIBLE_DEVICES with torchrun) or set vllm.colocate=true")
    return ""


def servers_on_one_node(world: int) -> bool:
    """Rank 0 started the servers and every rank is on its node: the weight group may meet on loopback."""
    local = local_world(0)
    return world <= 1 or (local > 0 and local == world)
