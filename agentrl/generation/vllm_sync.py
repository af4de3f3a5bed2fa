"""Learner weights into running vLLM servers, in place (no restart).

* ``SharedMemorySync`` (CPU, and any single machine): the trainer's rank 0 writes tensors, as they come
  from ``engine.iter_weights()`` (under ZeRO-3 gathered one at a time, so the learner never holds the
  whole model in one buffer), into one shared-memory file; each server's workers load it in one in-place
  reload through the worker extension ``agentrl.generation.vllm_ext.SharedMemoryWeights`` (vLLM's
  ``/collective_rpc``: a reload is per whole model, its post-processing runs once all layers are in),
  then the server's prefix cache is reset (cached keys and values came from the old weights).
* ``NcclSync`` (GPU servers on other devices): vLLM's own weight-transfer engine
  (``--weight-transfer-config '{"backend": "nccl"}'``): rank 0 broadcasts over NCCL, parameters gathered
  layer by layer by the source below. Built on vLLM's trainer-side API; it needs CUDA and was not run
  on the CPU machines this project is tested on.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

SHM_DIR = os.environ.get("AGENTRL_SHM_DIR", "/dev/shm")


class SyncError(RuntimeError):
    pass


class SharedMemorySync:
    name = "shm"

    def __init__(self, shm_dir: str = SHM_DIR):
        self.dir = Path(shm_dir)

    def write(self, weights: Iterable[tuple[str, torch.Tensor | None]]) -> tuple[Path, str]:
        """The tensors into a fresh file as they come; returns it and the manifest the extension reads."""
        path = self.dir / f"agentrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tensors, off = [], 0
        with open(path, "wb") as f:
            for name, t in weights:
                if t is None:  # another rank's share of a collective gather
                    continue
                raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
                f.write(raw.tobytes())
                tensors.append(dict(name=name, dtype=str(t.dtype).replace("torch.", ""), shape=list(t.shape),
                                    offset=off, nbytes=int(raw.nbytes)))
                off += int(raw.nbytes)
        return path, json.dumps(dict(path=str(path), size=off, tensors=tensors))

    def push(self, clients: dict[str, Any], weights: Iterable[tuple[str, torch.Tensor | None]]
             ) -> dict[str, str]:
        """Load ``weights`` into every client's server; returns {server name: error} for those that failed
        (they hold a mix of old and new weights and must not be sampled from until synced again)."""
        failed: dict[str, str] = {}
        path, manifest = self.write(weights)
        try:
            for name, client in clients.items():
                try:
                    client.collective_rpc("agentrl_load_shm", [manifest])
                    client.reset_prefix_cache()
                except Exception as e:  # reported by name; the others still get the weights
                    failed[name] = f"{type(e).__name__}: {e}"
        finally:
            path.unlink(missing_ok=True)
        return failed


class NcclSync:  # pragma: no cover - needs CUDA and vLLM in the trainer's environment
    name = "nccl"

    def __init__(self, engine: Any, urls: dict[str, str], master_address: str = "127.0.0.1",
                 base_port: int = 29700, server_world: int = 1):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        from agentrl import dist

        source = _engine_source(engine)
        self.engines = {}
        for k, (name, url) in enumerate(sorted(urls.items())):
            info = NCCLTrainerInitInfo(master_address, base_port + k, 1 + server_world, rank=dist.rank())
            self.engines[name] = WeightTransferTrainerFactory.trainer_init(
                info, client=HTTPVLLMWeightSyncClient(url), source=source)

    def push(self, clients: dict[str, Any], weights: Any = None) -> dict[str, str]:
        failed = {}
        for name, eng in self.engines.items():
            if name not in clients:
                continue
            try:
                eng.send_weights()
                clients[name].reset_prefix_cache()
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {e}"
        return failed


def _engine_source(engine: Any) -> Any:  # pragma: no cover - GPU path
    """vLLM's ``WeightSource`` over an agentrl engine: metadata from the (unsharded) shapes, iteration
    through ``engine.iter_weights`` (ZeRO-3: one parameter gathered at a time, on every rank)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class EngineSource(WeightSource):
        def metadata(self) -> list[Any]:
            return [ParamMeta(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                    for n, p in engine_named_parameters(engine)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from engine.iter_weights()

    return EngineSource()


def engine_named_parameters(engine: Any) -> list[tuple[str, Any]]:  # pragma: no cover - GPU path
    ds = getattr(engine, "ds", None)
    module = ds.module.policy if ds is not None else engine.merged_model()
    return list(module.named_parameters())
