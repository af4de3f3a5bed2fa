"""Run by tests/test_rank_failure.py: this process starts a stand-in vLLM server (tests/fake_vllm_server.py) as
``VLLMServer`` starts vLLM (a process group of its own), writes the server's pid to PID_FILE, then ends by
one of the hard exits that skip the trainer's close:

    sigterm    the CLI's SIGTERM handler (agentrl train's), then the test sends SIGTERM
    watchdog   the weight sync's watchdog: a transfer that never returns
    cleanup    a failing rank's exit whose cleanup runs past its limit

    python tests/server_exit_worker.py MODE PID_FILE
"""
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from agentrl import dist
from agentrl.commands.train import _say_where_sigterm_stops
from agentrl.generation import vllm
from agentrl.generation.vllm_sync import watchdog
from agentrl.launch import free_port

mode, pid_file = sys.argv[1], Path(sys.argv[2])
fake = Path(__file__).resolve().parent / "fake_vllm_server.py"
vllm.vllm_command = lambda model_dir, port, **kw: [sys.executable, str(fake), "--port", str(port), "--port-file",
                                                   f"{pid_file}.port", "--log", f"{pid_file}.log"]
server = vllm.VLLMServer(pid_file.parent, port=free_port())
server.start(timeout=60)
if mode == "sigterm":
    _say_where_sigterm_stops(SimpleNamespace(is_main=True, out_dir=pid_file.parent, step=0))
pid_file.write_text(str(server.proc.pid))
if mode == "watchdog":
    with watchdog(0.5, "the test's transfer"):
        time.sleep(120)
elif mode == "cleanup":
    dist._exit_now(1, lambda: time.sleep(120), limit_s=0.5)
time.sleep(120)
