"""Run by tests/test_vllm_sync.py under `torchrun --nproc_per_node=2`: the vLLM fleet's shared-memory sync
on two gloo ranks against stand-in servers (tests/fake_vllm_server.py), passes driven by files the test
writes. Each pass: every rank walks the weights (an all-reduce per tensor, as ZeRO-3's gathers) and rank 0
loads them into every live server; each rank prints which servers it holds live after the pass, or the
error it stopped with.

    worker.py DIR URL [URL ...]
"""
import sys
import time
from pathlib import Path

import torch

from agentrl import dist
from agentrl.config import TrainerCfg, VLLMCfg
from agentrl.generation.client import GenerationServerError
from agentrl.generation.vllm_fleet import VLLMFleet


class GatheringEngine:
    """What the fleet needs of a learner: its full-size parameters and ``iter_weights``, whose every tensor
    is a collective (as under ZeRO-3), so ranks that disagree on the pass would hang here."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))

    def merged_model(self):
        return self.model

    def iter_weights(self):
        import torch.distributed as tdist

        for name, p in self.model.named_parameters():
            t = p.detach().clone()
            tdist.all_reduce(t)
            yield name, (t if dist.rank() == 0 else None)


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.1)


def main() -> int:
    folder, urls = Path(sys.argv[1]), sys.argv[2:]
    dist.init("cpu")
    tcfg = TrainerCfg(generator="vllm", generator_url=urls, vllm_sync="shm", check_sync=False)
    fleet = VLLMFleet(tcfg, folder, "cpu", folder, vcfg=VLLMCfg(sync_timeout_s=3.0))
    engine = GatheringEngine()
    for k in range(1, 5):
        wait_for(folder / f"go{k}")
        t = time.monotonic()
        try:
            fleet.push(engine)
        except GenerationServerError as e:
            print(f"rank {dist.rank()} pass {k} error: {e}", flush=True)
            return 3
        print(f"rank {dist.rank()} pass {k} live={sorted(fleet.pool.live)} in {time.monotonic() - t:.1f}s",
              flush=True)
        dist.barrier()
        if dist.rank() == 0:
            (folder / f"done{k}").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
