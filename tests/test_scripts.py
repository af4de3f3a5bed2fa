"""Scripts a user runs beside the CLI: scripts/offline_bundle.py."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_offline_bundle_round_trip_skips_what_the_target_has(tmp_path, monkeypatch):
    """scripts/offline_bundle.py: parts under the size cap rejoin into the packed files; a module the
    target Python already imports is moved aside (its copy wins), one it lacks goes on PYTHONPATH; a
    missing part is a clear error, not a traceback."""
    spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
    ob = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ob)
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "games").mkdir(parents=True)
    (tmp_path / "cache" / "games" / "g1.txt").write_text("a game")
    parts = ob.pack(tmp_path / "b", ["more_itertools", "hashids"], ["games"], 20_000)
    assert len(parts) > 1 and all(p.stat().st_size <= 20_000 for p in parts)

    real = importlib.util.find_spec
    monkeypatch.setattr(ob.importlib.util, "find_spec", lambda m: None if m == "hashids" else real(m))
    got = ob.unpack(tmp_path / "b", tmp_path / "d")
    assert (got["kept"], got["skipped"]) == (["hashids"], ["more_itertools"])
    site = tmp_path / "d" / "site"
    assert (site / "hashids.py").read_bytes() == Path(real("hashids").origin).read_bytes()
    assert any(p.name.startswith("hashids-") for p in site.glob("*.dist-info"))
    assert not (site / "more_itertools").exists() and (tmp_path / "d" / "present-on-target" / "more_itertools").is_dir()
    assert (tmp_path / "d" / "cache" / "games" / "g1.txt").read_text() == "a game"
    assert f'PYTHONPATH="{site.resolve()}' in (tmp_path / "d" / "env.sh").read_text()

    parts[0].unlink()
    with pytest.raises(SystemExit, match="do not form one bundle"):
        ob.unpack(tmp_path / "b", tmp_path / "d2")
