"""Writes that a kill cannot tear: the new content goes to a temporary file next to the target, is flushed
to disk, then renamed over it (``os.replace`` is atomic on POSIX), so readers see the old file or the new
one, never half of either. And writes that stay in their folder: a run's own file that is a symbolic link
leaving the run folder is refused, never written through (``open_in_folder``).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any


class RunError(RuntimeError):
    """A run cannot go on for a reason outside the config (disk, permissions, its folder); one line for the user."""


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        # the rename replaces a link at ``path`` (its target is never written); a link planted at the
        # temporary name is refused rather than followed
        with open_in_folder(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_dir(folder: str | Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some filesystems refuse to open folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}


def open_in_folder(path: str | Path, mode: str = "w", folder: str | Path | None = None) -> IO[Any]:
    """``open(path, mode)`` for a file a run writes in its own folder (``folder``, else ``path``'s parent),
    never through a symbolic link that leaves it: such a link is one RunError naming the file and its
    target, and nothing is written. A link to a file inside the folder is followed. The final open is
    ``O_NOFOLLOW``, so a link swapped in after the check is refused too. Modes: w, a, a+ (text or ``b``)."""
    path = Path(path)
    base = Path(folder if folder is not None else path.parent).resolve()
    target = path
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(base):
            raise _outside(path, target)
    try:
        fd = os.open(target, _FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link put there between the check and the open
            raise _outside(path, Path(os.path.realpath(target))) from None
        raise
    return os.fdopen(fd, mode)


def _outside(path: Path, target: Path) -> RunError:
    return RunError(f"{path} is a symbolic link to {target}, outside the run folder: a run writes its own files "
                    "only inside its folder, so it will not write through it. Remove the link (or choose another "
                    "trainer.out_dir (--out))")
