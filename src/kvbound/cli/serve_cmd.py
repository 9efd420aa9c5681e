"""`kvbound serve`: the OpenAI-compatible server over one engine."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

from ..errors import KvboundError
from .options import (add_cache_args, add_engine_args, add_model_args, engine_policy, load_model, make_engine,
                      policy_defaults, positive_int)


def served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if not args.model:
        return "SmolLM2-135M-Instruct"
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def check_address(host: str, port: int):
    """Fail before the model loads if the address cannot be bound (a port in use, a host not here)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise KvboundError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise KvboundError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def build_engine(args):
    """The engine of the server's flags (in the engine's own process)."""
    model, tok, dtype = load_model(args)
    engine = make_engine(args, model, tok, dtype)
    print(f"kvbound: {engine.describe_pool()}", file=sys.stderr)
    return engine


def cmd_serve(args):
    from ..serve import EngineClient, ServerConfig, serve
    if not 0 < args.port < 65536:
        raise KvboundError(f"--port must be in 1..65535, got {args.port}")
    if args.pin_prefix:
        raise KvboundError("--pin-prefix: a server pins per request (the `pin` field, or pin_system_prompt)")
    engine_policy(args)
    check_address(args.host, args.port)
    config = ServerConfig(served_name(args), args.api_key, args.policy, args.budget, policy_defaults(args),
                          args.max_waiting)
    print("kvbound: loading the model in the engine process", file=sys.stderr)
    engine = EngineClient.process(build_engine, args, args.max_waiting)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvbound: serving on {args.host}, reachable from other machines"
              + ("" if args.api_key else " without an --api-key"), file=sys.stderr)
    serve(engine, config, args.host, args.port, args.log_level)


def add_serve_parser(sub):
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    add_cache_args(p)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every endpoint but /health")
    g.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the file's)")
    g.add_argument("--max-waiting", type=positive_int, default=256,
                   help="requests that may wait for a free sequence slot; past it, 429 (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
