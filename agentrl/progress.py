"""Progress of long work (games built, demonstrations played, SFT batches, training steps): a rich bar when
stdout is a terminal, else a plain line at most every few seconds (every step for training), so a first run
never sits silent for minutes. The one progress bar of the package.

These lines are the product's output (like the trainer's step lines), so they go to stdout; diagnostics
go through ``logging``.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType


class Progress:
    """``with Progress("demonstrations", total=400) as p: ... p.advance(info="...")``.

    ``enabled=False`` (ranks other than 0, tests) makes every call a no-op. Plain mode prints
    ``label: done/total (pct), N s[, info]`` (or ``line(done, info)``) when ``every_s`` seconds have passed
    since the last line, and once at the end. ``done``: what a resumed piece of work starts from."""

    def __init__(self, label: str, total: int, enabled: bool = True, every_s: float = 5.0, done: int = 0,
                 line: Callable[[int, str], str] | None = None):
        self.label, self.total, self.every_s, self._format = label, total, every_s, line
        self.done, self.info = done, ""
        self.enabled = enabled and total > 0
        self._t0 = self._last = time.monotonic()
        self._shown = done  # the count the last plain line showed
        self._bar = None
        if self.enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

            self._bar = Bar(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[info]}"))
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, completed=done, info="")

    def advance(self, n: int = 1, info: str = "") -> None:
        if not self.enabled:
            return
        self.done, self.info = min(self.total, self.done + n), info or self.info
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self.info)
        elif time.monotonic() - self._last >= self.every_s and self.done < self.total:
            self._line()

    def _line(self) -> None:
        self._last, self._shown = time.monotonic(), self.done
        if self._format is not None:
            print(self._format(self.done, self.info), flush=True)
            return
        pct = 100 * self.done / self.total
        info = f", {self.info}" if self.info else ""
        print(f"{self.label}: {self.done}/{self.total} ({pct:.0f}%), {self._last - self._t0:.0f} s{info}", flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        if self._bar is not None:
            self._bar.stop()
        elif self.done and self.done != self._shown:
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
