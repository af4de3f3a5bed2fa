"""A run never writes through a symbolic link that leaves its folder: the lock, config.yaml, metrics.jsonl and
eval_episodes.jsonl refuse such a link in one line naming the file (its target untouched); atomic writes (the
marker, final.json, manifests) replace the link itself, never its target."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.checkpoint import LOCK, MARKER, RunError, lock_run_folder
from agentrl.io_atomic import atomic_write_text, open_in_folder
from agentrl.metrics import MetricsLogger


@pytest.fixture
def outside(tmp_path):
    f = tmp_path / "outside.txt"
    f.write_text("precious\n")
    return f


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.mark.parametrize("mode", ["w", "a", "a+", "wb"])
def test_a_link_leaving_the_folder_is_refused_naming_the_file(folder, outside, mode):
    (folder / "log.txt").symlink_to(outside)
    with pytest.raises(RunError, match=rf"^{folder / 'log.txt'} is a symbolic link to {outside}, outside the run "
                                       r"folder: .* Remove the link"):
        open_in_folder(folder / "log.txt", mode)
    assert outside.read_text() == "precious\n"


def test_plain_files_and_links_inside_the_folder_are_written(folder):
    with open_in_folder(folder / "a.txt", "w") as f:
        f.write("one\n")
    with open_in_folder(folder / "a.txt", "a") as f:
        f.write("two\n")
    (folder / "b.txt").symlink_to("a.txt")  # inside the folder: followed
    with open_in_folder(folder / "b.txt", "a") as f:
        f.write("three\n")
    assert (folder / "a.txt").read_text() == "one\ntwo\nthree\n"


def test_a_link_swapped_in_after_the_check_is_refused(folder, outside, monkeypatch):
    """The final open is O_NOFOLLOW: a link that appears between the check and the open is not followed."""
    (folder / "log.txt").symlink_to(outside)
    monkeypatch.setattr(Path, "is_symlink", lambda self: False)  # the check sees no link, as in the race
    with pytest.raises(RunError, match="is a symbolic link to .*outside.txt, outside the run folder"):
        open_in_folder(folder / "log.txt", "a")
    assert outside.read_text() == "precious\n"


def test_an_atomic_write_replaces_the_link_not_its_target(folder, outside):
    (folder / "final.json").symlink_to(outside)
    atomic_write_text(folder / "final.json", "{}")
    assert not (folder / "final.json").is_symlink() and (folder / "final.json").read_text() == "{}"
    assert outside.read_text() == "precious\n"
    # a link planted at the temporary name is refused, not followed
    (folder / f".marker.tmp-{os.getpid()}").symlink_to(outside)
    with pytest.raises(RunError, match="outside the run folder"):
        atomic_write_text(folder / "marker", "x")
    assert outside.read_text() == "precious\n" and not (folder / "marker").exists()


def test_the_lock_and_the_metrics_refuse_a_link_out(folder, outside):
    (folder / LOCK).symlink_to(outside)
    with pytest.raises(RunError, match=rf"{LOCK} is a symbolic link"):
        lock_run_folder(folder)
    (folder / "metrics.jsonl").symlink_to(outside)
    log = MetricsLogger(folder, tensorboard=False)
    with pytest.raises(RunError, match="metrics.jsonl is a symbolic link"):
        log.log(1, {"reward": 1.0})
    log.close()
    assert outside.read_text() == "precious\n"


@pytest.mark.slow
def test_the_cli_refuses_a_config_yaml_link_in_one_line(tiny_model_dir, tmp_path, outside):
    """A real ``agentrl train``: a run folder (marker and all) whose config.yaml links out is one line on
    stderr, rc 2 (an error), no traceback, and the link's target is untouched."""
    out = tmp_path / "run"
    out.mkdir()
    atomic_write_text(out / MARKER, '{"run_id": "r1"}')
    (out / "config.yaml").symlink_to(outside)
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "grpo", "--env", "bandit",
           f"model.name={tiny_model_dir}", f"trainer.out_dir={out}", "trainer.steps=1", "sft.enabled=false",
           "eval.tasks=0", "trainer.progress=false", "trainer.tensorboard=false"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "config.yaml is a symbolic link to" in err[0] and "Traceback" not in p.stderr, p.stderr
    assert outside.read_text() == "precious\n"
