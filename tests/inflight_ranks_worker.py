"""Run by tests/test_inflight.py under `torchrun --nproc_per_node=2`: in-flight updates into a stand-in vLLM
server (tests/fake_vllm_server.py) from two gloo ranks. Each rank generates rows in a thread while both
ranks offer two new versions (the fleet's ``offer`` is collective; rank 0 holds the staged copy); each rank
writes its completions' token ids and per-token version labels to DIR/rankR.json.

    worker.py DIR URL
"""
import json
import sys
import threading
import time
from pathlib import Path

import torch

from agentrl import dist
from agentrl.config import TrainerCfg, VLLMCfg
from agentrl.generation.vllm_fleet import StagedTensors, VLLMFleet
from agentrl.types import SamplingParams


def main() -> int:
    folder, url = Path(sys.argv[1]), sys.argv[2]
    dist.init("cpu")
    tcfg = TrainerCfg(generator="vllm", generator_url=url, vllm_sync="shm", check_sync=False)
    fleet = VLLMFleet(tcfg, folder, "cpu", folder, vcfg=VLLMCfg(sync_timeout_s=30.0))
    fleet.inflight = True
    weights = [("w", torch.ones(4, 4))] if dist.rank() == 0 else []
    got: dict[str, list] = {}

    def rows() -> None:
        got["out"] = fleet.generate([[1, 2, 3]] * 3, SamplingParams(max_new_tokens=150))

    worker = threading.Thread(target=rows)
    worker.start()
    for version in (1, 2):
        time.sleep(0.15 + 0.1 * dist.rank())  # the ranks reach the offer at different times
        fleet.offer(version, StagedTensors(weights))
    worker.join(120)
    (folder / f"rank{dist.rank()}.json").write_text(json.dumps(dict(
        version=fleet.version, loads=fleet.inflight_loads,
        rows=[dict(ids=c.ids, versions=c.versions, finish=c.finish_reason) for c in got["out"]])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
