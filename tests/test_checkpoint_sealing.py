"""Checkpoint sealing by every rank's share, and the free-space check from a checkpoint's real size."""
import threading
from pathlib import Path

import pytest

from agentrl import checkpoint as ckpt


def _save(folder: Path) -> None:
    (folder / "deepspeed" / "global_step1").mkdir(parents=True)
    for r in (0, 1):
        (folder / "deepspeed" / "global_step1" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(
            bytes([r]) * (5000 + r))
        (folder / f"rng-rank{r}.pt").write_bytes(b"rng" * (r + 1))
    (folder / "model").mkdir()
    (folder / "model" / "model.safetensors").write_bytes(b"w" * 9000)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "trainer.pt").write_bytes(b"t" * 300)


def test_each_rank_hashes_its_own_files_and_rank_0_seals_the_same_manifest(tmp_path):
    one, two = tmp_path / "one" / "step-000001", tmp_path / "two" / "step-000001"
    for f in (one, two):
        f.parent.mkdir()
        ckpt.begin(f, "run", 1)
        _save(f)
    ckpt.seal(one, "run", 1)  # one process hashes everything

    shared: list = [None, None]
    hashed: list = [None, None]
    meet = threading.Barrier(2)

    def all_gather(rank):
        def gather(obj):
            shared[rank] = obj
            meet.wait()
            return list(shared)
        return gather

    real = ckpt.hash_share

    def rank(r):
        hashed[r] = real(two, r, 2)
        ckpt.seal_by_ranks(two, "run", 1, r, 2, all_gather(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = ckpt.read_manifest(one), ckpt.read_manifest(two)
    assert a["files"] == b["files"] and b["state"] == "complete" and ckpt.verify(two) is None
    assert not set(hashed[0]) & set(hashed[1]) and set(hashed[0]) | set(hashed[1]) == set(a["files"])
    for r in (0, 1):  # a rank's own files (its ZeRO shard, its RNG) by that rank, the rest shared out by size
        assert f"deepspeed/global_step1/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in hashed[r]
        assert f"rng-rank{r}.pt" in hashed[r]
    load = [sum(v["bytes"] for v in hashed[r].values()) for r in (0, 1)]
    assert abs(load[0] - load[1]) <= 9000  # balanced to within the largest file


def test_a_rank_that_cannot_hash_fails_every_rank(tmp_path, monkeypatch):
    folder = tmp_path / "step-000001"
    ckpt.begin(folder, "run", 1)
    _save(folder)
    monkeypatch.setattr(ckpt, "hash_share", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.seal_by_ranks(folder, "run", 1, 0, 2, lambda obj: [obj, {}])
    assert not ckpt.is_sealed(folder)


def test_checkpoint_size_of_a_torch_run_is_its_real_size_and_the_free_space_check_uses_it(tiny_model_dir, tmp_path,
                                                                                            monkeypatch):
    from agentrl.learner.engine import EngineConfig, TorchEngine

    from tests.ds_zero3_worker import data, loss_fn

    cfg = EngineConfig()
    eng = TorchEngine(tiny_model_dir, cfg)
    eng.step(data(eng.pad_id), loss_fn)  # Adam's moments exist from the first step on
    eng.save(tmp_path / "ckpt")
    real = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    est = ckpt.engine_checkpoint_bytes(tiny_model_dir, "torch", cfg)
    params = ckpt.safetensors_params(tiny_model_dir)
    assert params == sum(p.numel() for p in eng.model.parameters())
    assert 0.9 * real < est <= real  # the tokenizer's files and the pickles' headers are the difference
    free = int(2.5 * est)  # room for 2 checkpoints, not the 3 that keep_checkpoints=2 needs while saving
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: type("U", (), dict(free=free))())
    with pytest.raises(ckpt.RunError, match="2 kept \\+ the one being written"):
        ckpt.check_free_space(tmp_path, est, keep=2)
    ckpt.check_free_space(tmp_path, est, keep=1)


def test_documented_checkpoint_sizes():
    # docs/reference/training.md's table: ZeRO-3 shards 12 bytes a parameter, a bf16 export 2 (Qwen2.5 sizes)
    gb = lambda n: round(ckpt.checkpoint_bytes(n, "deepspeed", "float32", export_dtype="bfloat16") / 1e9)  # noqa: E731
    assert (gb(1_543_714_304), gb(3_085_938_688), gb(7_615_616_512)) == (22, 43, 107)
    assert ckpt.checkpoint_bytes(10, "deepspeed", "float32") == 10 * (12 + 4)
    assert ckpt.checkpoint_bytes(10, "torch", "float32", critic_params=10) == 10 * 12 * 2 + 10 * 4
    text = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "training.md").read_text()
    assert "| 7B | 7.62 B | 91 GB | 15 GB | 107 GB | 320 GB | 122 GB |" in text
