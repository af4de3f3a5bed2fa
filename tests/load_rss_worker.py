"""Run under `torchrun --nproc_per_node=2` by tests/test_deepspeed_memory.py (and by hand to measure): builds a
DeepSpeedEngine on MODEL and writes this rank's peak anonymous resident memory during the build (sampled
every 5 ms from /proc/self/status; file pages of the memory-mapped safetensors are the page cache, shared by
the ranks) and the model's fp32 size, to OUT/rank{R}.json. An export of the weights is measured the same way
when a third argument names a folder (a fourth: its shard size in MB)."""
import json
import os
import sys
import threading
import time


def anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    def __init__(self):
        self.base, self.peak, self.stop = anon_mb(), 0.0, threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, anon_mb())
            time.sleep(0.005)

    def done(self) -> float:
        self.stop.set()
        self.t.join()
        return max(self.peak, anon_mb()) - self.base


def main(model: str, out: str, export: str = "", shard_mb: str = "") -> None:
    import torch  # noqa: F401  (imports outside the measured span)
    import transformers  # noqa: F401
    import deepspeed  # noqa: F401

    from agentrl.learner.deepspeed_engine import DeepSpeedEngine
    from agentrl.learner.engine import EngineConfig

    p = Peak()
    eng = DeepSpeedEngine(model, EngineConfig(device="cpu"))
    load = p.done()
    n = eng.full_numel()
    report = dict(rank=eng.rank, load_peak_mb=load, model_fp32_mb=n * 4 / 2**20, partition=eng.partition_numel())
    if export:
        if shard_mb:
            eng.export_shard_mb = int(shard_mb)
        p = Peak()
        eng.export_weights(export)
        report["export_peak_mb"] = p.done()
    with open(os.path.join(out, f"rank{eng.rank}.json"), "w") as f:
        json.dump(report, f)
    eng.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
