"""`agentrl serve`: serve a policy over the OpenAI completions protocol (ours, or vLLM)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a policy over HTTP (OpenAI completions protocol)",
                       description="Serve a policy for rollouts. --backend agentrl runs our server in this process; "
                                   "--backend vllm starts `vllm serve` on the same model folder.")
    p.add_argument("--model", default="tiny",
                   help="tiny | tiny:KEY=N,... | smollm2 | path to an HF model folder (default: tiny)")
    p.add_argument("--backend", default="agentrl", choices=["agentrl", "vllm"])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", help="agentrl backend: torch dtype (default float32)")
    p.add_argument("--lora", action="store_true", help="vllm backend: accept LoRA adapters at run time")
    p.add_argument("--allow-weights-dir", action="append", default=[], metavar="DIR",
                   help="agentrl backend: /load_weights may load folders under DIR (repeatable; default: none, "
                        "every load is refused). A training run syncs through RUN_DIR/weights: allow its run folder")
    p.add_argument("--api-key", default=os.environ.get("AGENTRL_API_KEY"),
                   help="agentrl backend: require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $AGENTRL_API_KEY; none: no key)")
    p.add_argument("--max-request-tokens", type=int, default=1 << 17, metavar="N",
                   help="agentrl backend: refuse (400) a request whose prompts x n x max_tokens is more than N "
                        "(default 131072)")
    p.add_argument("--max-client-tokens", type=int, default=1 << 20, metavar="N",
                   help="agentrl backend: answer 429 (Retry-After) while one client address has more than N tokens "
                        "(prompt + max_tokens, every row) queued or running (default 1048576)")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="agentrl backend: open connections and requests in flight; beyond, 503 (default 1024). "
                        "The last quarter is kept for client addresses holding fewer than 8 connections")
    p.add_argument("--max-client-connections", type=int, default=256, metavar="N",
                   help="agentrl backend: open connections from one client address; beyond, a new one is answered "
                        "503 at once and takes none of --max-connections (default 256)")
    p.add_argument("--max-batch-kv-mb", type=int, default=1024, metavar="MB",
                   help="agentrl backend: KV cache one batched generate may take (default 1024 MiB; a request "
                        "bigger than that runs alone)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agentrl.model_zoo import resolve_model

    folder = resolve_model(args.model)
    if args.backend == "vllm":
        from agentrl.generation.vllm import is_loopback, vllm_command, vllm_env
        from agentrl.generation.vllm_auth import KEY_ENV, MIDDLEWARE

        if not is_loopback(args.host) and not args.api_key:  # refused before anything else is looked at
            print(f"error: --host {args.host} reaches beyond this machine: give --api-key (or ${KEY_ENV}); "
                  "every route of the server then takes it", file=sys.stderr)
            return 2
        cmd = vllm_command(folder, args.port, args.host, lora=args.lora)
        env = vllm_env(None, args.lora)
        if MIDDLEWARE in cmd:  # bound beyond loopback: every route takes the key
            env[KEY_ENV] = args.api_key
        print("exec:", " ".join(cmd), flush=True)
        # our logits processor (constrained decoding) must be importable by vLLM's interpreter
        os.execve(cmd[0], cmd, env)
    from agentrl.generation.embedded import EmbeddedGenerator
    from agentrl.generation.requests import ServerLimits
    from agentrl.generation.server import start_server

    for flag in ("max_request_tokens", "max_client_tokens", "max_connections", "max_client_connections",
                 "max_batch_kv_mb"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    limits = ServerLimits(max_request_tokens=args.max_request_tokens, max_client_tokens=args.max_client_tokens,
                          max_connections=args.max_connections, max_client_connections=args.max_client_connections,
                          max_batch_kv_mb=args.max_batch_kv_mb)
    generator = EmbeddedGenerator.from_folder(folder, args.dtype)
    try:
        server = start_server(generator, str(args.model), args.host, args.port,
                              allow_weights_dirs=args.allow_weights_dir, api_key=args.api_key, limits=limits)
    except OSError as e:  # the port is taken, or the address is not this machine's
        why = os.strerror(e.errno) if e.errno else str(e)
        print(f"error: cannot listen on {args.host}:{args.port} ({why}): pick another --port or --host",
              file=sys.stderr)
        return 2
    print(f"serving {args.model} ({folder}) on http://{args.host}:{server.server_address[1]}  (Ctrl-C stops)",
          flush=True)
    try:
        _wait()  # the server runs on its own thread
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.shutdown()
    return 0


def _wait() -> None:
    import threading

    threading.Event().wait()
