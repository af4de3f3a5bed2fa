"""Carry a GPU study's state from one sitting to the next, where every copy is capped: back from the machine
in files of at most 16 MiB (64 MiB a command), to it in 64 MiB a command with the checkout. A study folder
(scripts/gpu_from_one_warm_start.sh's OUT) is packed into pieces, the pieces are returned a few per command,
joined and cut again into parts of 50 MiB here, carried one part per command, and unpacked to the same path
on the next machine, where rerunning the study resumes every run from its checkpoint.

On the GPU machine (`scripts/gpu_sitting.sh ship` and `give K` call this):

    python3 scripts/sitting_state.py pack STUDY DEST [--only ws|runs] [--piece-mib 15] [--max-mib 600]

Here, with the returned pieces copied into one folder:

    python3 scripts/sitting_state.py repart PIECES carry/ [--part-mib 50]

On the next machine, with the carried parts in one folder (`gpu_sitting.sh start` does it):

    python3 scripts/sitting_state.py unpack PARTS STUDY

What is packed is what a later sitting cannot remake, as two sets that travel apart: `ws`, the shared
warm start's weights (STUDY/ws/warm_start; CUDA does not remake them bit for bit), which never change and so
come back once, and `runs`, each run's latest checkpoint without its merged `model/` export (engine.pt and
trainer.pt: learner, optimizer, recipe and RNG state), config, metrics and logs, which come back after every
sitting. Left out: the runs' copies of the warm start, older checkpoints, TensorBoard files, and the
warm-start run's own checkpoint. Each set is NAME.partNN files and NAME.sha256. The warm start's float32
tensors travel as bf16, which halves them; unpack writes them back as float32, so only their values are
rounded (bf16 autocast rounds the weights of every matmul anyway). `--keep-dtype` carries them exactly.
A fully fine-tuned run's checkpoint holds every weight and Adam's two moments (~1.6 GB for SmolLM2): RL on
LoRA adapters (`model.lora_r=16`) keeps it to tens of MB.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path

SETS = ("ws", "runs")  # NAME.part00, NAME.part01, ... and NAME.sha256: the joined stream's size and digest,
# so that a missing or truncated part is found before extracting


def _keep(rel: Path, ws: str, current: dict[str, str]) -> bool:
    """Whether the file STUDY/rel goes into the pack (see the module's docstring); its first four path
    components decide, so a file under a skipped folder is skipped too."""
    parts = rel.parts
    if len(parts) < 2:
        return True  # the study's own files: summary.jsonl, logs
    run, rest = parts[0], parts[1:]
    if rest[0] == "tb":
        return False
    if rest[0] == "warm_start":
        return run == ws
    if rest[0] in ("checkpoint", "checkpoints"):
        if run == ws:  # all a later sitting takes from the warm-start run is the warm start
            return False
        if rest[0] == "checkpoint":
            return True  # the link itself
        return rest[1] == current.get(run) and not (len(rest) >= 3 and rest[2] == "model")
    return True


def _files(study: Path, ws: str) -> list[Path]:
    current = {}  # run -> the checkpoint folder its `checkpoint` link names
    for link in study.glob("*/checkpoint"):
        if link.is_symlink():
            current[link.parent.name] = Path(os.readlink(link)).name
    out = []
    for path in sorted(study.rglob("*")):
        rel = path.relative_to(study)
        if (path.is_file() or path.is_symlink()) and _keep(rel, ws, current):
            out.append(rel)
    return out


def _to_dtype(src: Path, dtype: str) -> bytes:
    """A safetensors file with its float32 tensors (or, back, its bf16 ones) in the other dtype."""
    import torch
    from safetensors.torch import load_file, save

    a, b = (torch.float32, torch.bfloat16) if dtype == "bf16" else (torch.bfloat16, torch.float32)
    t = load_file(str(src))
    return save({k: v.to(b) if v.dtype == a else v for k, v in t.items()}, metadata={"format": "pt"})


def _parts(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f"{name}.part*"), key=lambda p: int(p.name.rsplit(".part", 1)[1]))


def pack(study: Path, dest: Path, sets: tuple[str, ...] = SETS, ws: str = "ws", piece_bytes: int = 15 << 20,
         max_bytes: int = 600 << 20, keep_dtype: bool = False) -> list[Path]:
    """STUDY's state as DEST/NAME.partNN pieces of at most piece_bytes and DEST/NAME.sha256, for each set
    NAME in ``sets``; returns the pieces, set by set."""
    every = _files(study, ws)
    of_set = {"ws": [f for f in every if f.parts[:2] == (ws, "warm_start")],
              "runs": [f for f in every if f.parts[:2] != (ws, "warm_start")]}
    out = []
    for name in sets:
        out += _pack(study, of_set[name], dest, name, ws, piece_bytes, max_bytes, keep_dtype)
    return out


def _pack(study: Path, files: list[Path], dest: Path, name: str, ws: str, piece_bytes: int, max_bytes: int,
          keep_dtype: bool) -> list[Path]:
    cast = [] if keep_dtype else [str(f) for f in files
                                  if f.parts[:2] == (ws, "warm_start") and f.suffix == ".safetensors"]
    dest.mkdir(parents=True, exist_ok=True)
    for old in _parts(dest, name) + [dest / f"{name}.sha256"]:
        old.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        tar_path = Path(tmp) / "state.tar"
        with tarfile.open(tar_path, "w") as tar:
            for rel in files:
                if str(rel) in cast:
                    data = _to_dtype(study / rel, "bf16")
                    info = tarfile.TarInfo(str(rel))
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.add(study / rel, arcname=str(rel), recursive=False)
            manifest = json.dumps({"files": [str(f) for f in files], "bf16": cast}).encode()
            info = tarfile.TarInfo(f"sitting_state.{name}.json")
            info.size = len(manifest)
            tar.addfile(info, io.BytesIO(manifest))
        size = tar_path.stat().st_size
        if size > max_bytes:
            big = sorted(files, key=lambda f: (study / f).stat().st_size if (study / f).is_file() else 0)[-3:]
            hint = (" A fully fine-tuned run's checkpoint holds every weight and Adam's moments: train RL on LoRA "
                    "adapters (model.lora_r=16), or raise --max-mib" if name == "runs" else " Raise --max-mib")
            raise SystemExit(f"sitting_state: {study}'s {name} set is {size / 2**20:.0f} MiB, over --max-mib "
                             f"{max_bytes >> 20} (largest: {', '.join(map(str, reversed(big)))}).{hint}")
        return _cut(tar_path, dest, name, piece_bytes)


def _cut(stream: Path, dest: Path, name: str, piece_bytes: int) -> list[Path]:
    digest, pieces = hashlib.sha256(), []
    with open(stream, "rb") as f:
        while chunk := f.read(piece_bytes):
            digest.update(chunk)
            pieces.append(dest / f"{name}.part{len(pieces):02d}")
            pieces[-1].write_bytes(chunk)
    (dest / f"{name}.sha256").write_text(json.dumps({"bytes": stream.stat().st_size, "sha256": digest.hexdigest(),
                                                     "parts": len(pieces)}) + "\n")
    return pieces


def _sets(src: Path) -> list[str]:
    names = sorted(p.name[:-len(".sha256")] for p in src.glob("*.sha256"))
    if not names:
        raise SystemExit(f"sitting_state: {src} has no NAME.sha256: carry each set's digest with its parts")
    return names


def _join(src: Path, name: str, out: Path) -> None:
    """The set's parts in src, in order, into the file out; refused unless they are the whole stream."""
    want = json.loads((src / f"{name}.sha256").read_text())
    parts = _parts(src, name)
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for p in parts:
            data = p.read_bytes()
            digest.update(data)
            f.write(data)
    got = out.stat().st_size
    if got != want["bytes"] or digest.hexdigest() != want["sha256"]:
        raise SystemExit(f"sitting_state: the {len(parts)} {name} parts in {src} hold {got} bytes, not the "
                         f"{want['bytes']} packed (in {want['parts']} parts), or other bytes: is one missing or "
                         "cut short?")


def repart(src: Path, dest: Path, part_bytes: int = 50 << 20) -> list[Path]:
    """Each set's returned pieces joined and cut again into parts of at most part_bytes (fewer copies to
    carry)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in _sets(src):
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            joined = Path(tmp) / "state.tar"
            _join(src, name, joined)
            for old in _parts(dest, name):
                old.unlink()
            out += _cut(joined, dest, name, part_bytes)
    return out


def unpack(src: Path, study: Path) -> dict:
    """Join each set's parts, extract them under STUDY (the path the runs were packed from: their configs
    name it) and turn the warm start's bf16 tensors back into float32."""
    study.mkdir(parents=True, exist_ok=True)
    got: dict = {"study": str(study), "files": 0, "bf16_restored": []}
    for name in _sets(src):
        with tempfile.TemporaryDirectory(dir=study) as tmp:
            joined = Path(tmp) / "state.tar"
            _join(src, name, joined)
            with tarfile.open(joined) as tar:
                tar.extractall(study, filter="data")
        manifest = json.loads((study / f"sitting_state.{name}.json").read_text())
        for rel in manifest["bf16"]:
            path = study / rel
            path.write_bytes(_to_dtype(path, "fp32"))
        got["files"] += len(manifest["files"])
        got["bf16_restored"] += manifest["bf16"]
        got.setdefault("sets", []).append(name)
    return got


def main(argv: list[str] | None = None) -> None:
    head, *rest = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=head, epilog="\n\n".join(rest),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="STUDY's state as pieces in DEST")
    p.add_argument("study", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--ws", default="ws", help="the study's warm-start run folder (default ws)")
    p.add_argument("--only", choices=SETS, help="pack one set: ws (the warm start) or runs (all else)")
    p.add_argument("--piece-mib", type=int, default=15, help="largest piece in MiB (default 15: four to a return)")
    p.add_argument("--max-mib", type=int, default=600, help="refuse a state larger than this (default 600)")
    p.add_argument("--keep-dtype", action="store_true", help="carry the warm start's float32 tensors as they are")
    r = sub.add_parser("repart", help="join the pieces in SRC and cut them into parts in DEST")
    r.add_argument("src", type=Path)
    r.add_argument("dest", type=Path)
    r.add_argument("--part-mib", type=int, default=50, help="largest part in MiB (default 50)")
    u = sub.add_parser("unpack", help="join the parts in SRC and extract them under STUDY")
    u.add_argument("src", type=Path)
    u.add_argument("study", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        if a.piece_mib < 1:
            ap.error("--piece-mib must be at least 1")
        got = pack(a.study, a.dest, (a.only,) if a.only else SETS, a.ws, a.piece_mib << 20, a.max_mib << 20,
                   a.keep_dtype)
    elif a.cmd == "repart":
        if a.part_mib < 1:
            ap.error("--part-mib must be at least 1")
        got = repart(a.src, a.dest, a.part_mib << 20)
    else:
        print(json.dumps(unpack(a.src, a.study)))
        return
    for part in got:
        print(f"{part}  {part.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
