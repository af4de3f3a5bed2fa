"""Reading a run folder: its config, metrics and rollout records (``agentrl.runs.open``).

The records files may be growing (a live run) or end in a torn member (a killed one): ``refresh`` reads on
from the last complete member, and a torn tail is simply not there yet.
"""
from __future__ import annotations

import io
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentrl.metrics import read_metrics
from agentrl.runs.records import SPLITS, members, records_path


@dataclass
class StepRecords:
    """One step's records: ``episodes`` are dicts with the schema of ``agentrl.runs.records.episode_record``."""

    step: int
    split: str
    groups_total: int
    episodes_total: int
    episodes: list[dict[str, Any]] = field(default_factory=list)
    time: float = 0.0

    def groups(self) -> dict[str, list[dict[str, Any]]]:
        """The recorded episodes by group id, in the step's order."""
        out: dict[str, list[dict[str, Any]]] = {}
        for e in self.episodes:
            out.setdefault(e["group"], []).append(e)
        return out


class _Index:
    """Where each step's member lies in one records file (the last member of a step wins: a resumed run's)."""

    def __init__(self, path: Path):
        self.path, self.size, self.offsets = path, 0, {}  # step -> (start, end)
        self.tail = b""  # the last bytes read: a file cut back and rewritten differs there
        self.heads: dict[int, dict[str, Any]] = {}

    def refresh(self) -> bool:
        """Read the members appended since; True when the file was cut back (a resumed run) and read anew."""
        size = self.path.stat().st_size if self.path.exists() else 0
        with open(self.path, "rb") if size else _nothing() as f:
            f.seek(max(0, self.size - 64))
            # the bytes this index ended on are still there: the file only grew, else it was cut back and rewritten
            anew = size < self.size or f.read(min(64, self.size)) != self.tail
            if anew:
                self.size, self.offsets, self.heads, self.tail = 0, {}, {}, b""
            if size == self.size:
                return anew
            f.seek(self.size)
            data = f.read()
        base = self.size
        for start, end, text in members(data):
            head = json.loads(text.split(b"\n", 1)[0])
            self.offsets[head["step"]] = (base + start, base + end)
            self.heads[head["step"]] = head
            self.size = base + end
        self.tail = (data[: self.size - base])[-64:] if self.size - base >= 64 else \
            (self.tail + data[: self.size - base])[-64:]
        return anew


class RunRecords:
    """A run folder opened for reading: ``config``, ``metrics()``, ``steps(split)``, ``step(n, split)``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a run folder (no such directory)")
        self._index = {s: _Index(records_path(self.path, s)) for s in SPLITS}
        self._cache: OrderedDict[tuple[str, int], StepRecords] = OrderedDict()
        self.refresh()

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def config(self) -> dict[str, Any]:
        p = self.path / "config.yaml"
        return (yaml.safe_load(p.read_text()) or {}) if p.exists() else {}

    def refresh(self) -> None:
        """Read what the run appended since (a live run)."""
        for ix in self._index.values():
            if ix.refresh():
                self._cache.clear()

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def steps(self, split: str = "train") -> list[int]:
        """The steps with records, in order."""
        return sorted(self._index[split].offsets)

    def heads(self, split: str = "train") -> list[dict[str, Any]]:
        ix = self._index[split]
        return [ix.heads[s] for s in sorted(ix.heads)]

    def step(self, n: int, split: str = "train") -> StepRecords:
        """Step ``n``'s records (KeyError naming the recorded steps when it has none)."""
        key = (split, n)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ix = self._index[split]
        if n not in ix.offsets:
            have = self.steps(split)
            raise KeyError(f"{self.path}: no {split} records for step {n} (recorded: "
                           f"{_span(have) if have else 'none'})")
        start, end = ix.offsets[n]
        with open(ix.path, "rb") as f:
            f.seek(start)
            _, _, text = next(members(f.read(end - start)))
        lines = text.decode().splitlines()
        head = json.loads(lines[0])
        got = StepRecords(head["step"], head["split"], head.get("groups_total", 0), head.get("episodes_total", 0),
                          [json.loads(x) for x in lines[1:] if x.strip()], head.get("time", 0.0))
        self._cache[key] = got
        while len(self._cache) > 16:
            self._cache.popitem(last=False)
        return got


def _nothing() -> io.BytesIO:
    return io.BytesIO(b"")


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}, {len(steps)} steps" if len(steps) > 1 else str(steps[0])


def open_run(path: str | Path) -> RunRecords:
    """A run folder's config, metrics and rollout records."""
    return RunRecords(Path(path))
