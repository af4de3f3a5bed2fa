"""Where the learner ranks and the vLLM servers run, per node and GPU, and the layouts that cannot work.

One job: turn the config and a machine shape (nodes x GPUs per node) into a placement, as plain data. The
trainer refuses a server on a learner GPU with it before anything starts (``server_gpu_conflict``); the
launch plan (``agentrl train --dry-run``, ``agentrl.commands.plan``) prints it with the memory estimates.

Placement rules, as the trainer runs them: rank 0 starts ``trainer.vllm_servers`` servers on its own node
(node 0), server k on the GPUs ``trainer.vllm_gpus[k]`` names (e.g. ``"6"`` or ``"4,5"`` for
``vllm.tensor_parallel_size=2``); the learner ranks take every other GPU of every node, or every GPU when
the servers are colocated (``vllm.colocate``) on them.
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
            gpus = [(k * tp + i) % gpus_per_node for i in range(tp)]  # colocated: over the learner's GPUs
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


def learner_gpus_here(local_world: int) -> list[int]:
    """This node's learner GPUs as physical indices: the first ``local_world`` of CUDA_VISIBLE_DEVICES
    (the launcher's), else 0..local_world-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [int(x) for x in visible.split(",") if x.strip().isdigit()] if visible else []
    return ids[:local_world] if ids else list(range(local_world))


def server_gpu_conflict(tcfg: Any, vcfg: Any, device: str, world: int) -> str:
    """One line when a server the trainer would start on this node shares a learner GPU without
    ``vllm.colocate`` (vLLM reserves 0.92 of its GPU by default and NCCL refuses two ranks on one GPU), or
    has another number of GPUs than ``vllm.tensor_parallel_size``; empty when the layout can run."""
    if not device.startswith("cuda") or vcfg.colocate:
        return ""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world
    learner = set(learner_gpus_here(max(1, local)))
    for k in range(tcfg.vllm_servers):
        if k >= len(tcfg.vllm_gpus):
            return (f"vLLM server {k} has no GPU of its own (trainer.vllm_gpus has {len(tcfg.vllm_gpus)} entries) "
                    "and would share the learner's GPU: list its GPUs in trainer.vllm_gpus (e.g. [6, 7]) and "
                    "launch the ranks on the others, or set vllm.colocate=true with vllm.gpu_memory_utilization")
        gpus = gpu_list(tcfg.vllm_gpus[k])
        if len(gpus) != vcfg.tensor_parallel_size:
            return (f"vLLM server {k} has {len(gpus)} GPU(s) in trainer.vllm_gpus but "
                    f"vllm.tensor_parallel_size={vcfg.tensor_parallel_size}")
        shared = sorted(learner & set(gpus))
        if shared:
            return (f"vLLM server {k} would run on GPU {shared[0]}, a learner rank's GPU: launch the ranks on "
                    "the other GPUs (deepspeed --include localhost:...) or set vllm.colocate=true")
    return ""


def servers_on_one_node(world: int) -> bool:
    """Rank 0 started the servers and every rank is on its node: the weight group may meet on loopback."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return world <= 1 or (local > 0 and local == world)
