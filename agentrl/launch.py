"""Command lines that start agentrl on N local ranks (torchrun or the deepspeed launcher), for the
benchmark and the tests; users type the same commands (README, "Scaling out")."""
from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(nproc: int, args: list[str], launcher: str = "torchrun", script: str | None = None,
                 module: str = "agentrl.cli") -> list[str]:
    """``torchrun --nproc_per_node N -m MODULE ARGS`` or ``deepspeed --num_gpus N --module MODULE ARGS``
    (``script`` instead of a module), on a free loopback port."""
    bin_dir = Path(sys.executable).parent
    port = str(free_port())
    target = [script] if script else ["-m" if launcher == "torchrun" else "--module", module]
    if launcher == "deepspeed":
        return [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), "--master_addr", "127.0.0.1",
                "--master_port", port, *target, *args]
    if launcher != "torchrun":
        raise ValueError(f"launcher must be torchrun or deepspeed, got {launcher!r}")
    return [str(bin_dir / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
            *target, *args]
