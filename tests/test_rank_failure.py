"""An error on one of two DeepSpeed ranks (gloo, real processes) stops both in seconds, each saying why."""
import time

import psutil
import pytest

from tests.test_multirank import ROOT, launch


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_error_in_one_ranks_learner_step_stops_every_rank(tiny_model_dir, tmp_path, monkeypatch):
    """Rank 1 runs out of memory in its first learner step while rank 0 waits in ZeRO-3's collectives: rank 1
    prints its traceback and the memory hint, rank 0 exits naming rank 1, and no process is left, within
    60 s of the error (before: rank 1 waited at the closing barrier and nothing printed until a timeout)."""
    stamp = tmp_path / "failed_at"
    monkeypatch.setenv("FAIL_RANK", "1")
    monkeypatch.setenv("FAIL_STAMP", str(stamp))
    args = ["train", "grpo", "--env", "bandit", f"model.name={tiny_model_dir}", "trainer.engine=deepspeed",
            "sft.enabled=false", "trainer.steps=4", "eval.tasks=0", "rollout.groups=2", "rollout.group_size=2",
            "rollout.slots=2", "rollout.max_new_tokens=8", "trainer.tensorboard=false", "trainer.progress=false",
            "optim.token_budget=64", "algo.entropy_coef=0.01", "algo.filters=[dropped]",  # every step updates
            f"trainer.out_dir={tmp_path / 'run'}"]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = launch(2, args, script=str(ROOT / "tests" / "learner_failure_worker.py"), timeout=240)
    ended = time.time()
    assert stamp.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ended - float(stamp.read_text()) < 60
    assert proc.returncode != 0
    err = proc.stderr
    assert "[rank 1] Traceback" in err and "[rank 1] error: LearnerOutOfMemory: out of cpu memory" in err, err[-4000:]
    assert "optim.token_budget" in err  # the hint
    assert "[rank 0] stopping: rank 1 failed: LearnerOutOfMemory" in err, err[-4000:]
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE]
