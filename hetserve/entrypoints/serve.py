"""`hetserve serve`: build the engine from the engine options, check the bind is safe, run."""

from __future__ import annotations

import argparse

from hetserve import envs
from hetserve.config import add_engine_args
from hetserve.config_sections import is_loopback_host as is_loopback
from hetserve.entrypoints import check_output
from hetserve.errors import InvalidInputError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def register(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server (default: the demo model)")
    add_engine_args(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=None,
        help="require this bearer token on /v1/*, /api/* and /internal/* (and secure "
        "--kv-events)",
    )
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    g.add_argument(
        "--max-request-mb",
        type=float,
        default=8.0,
        help="largest request body accepted, in MiB (checked while the body is read)",
    )
    g.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter: clients then make "
        "the server read adapter directories they name (trusted clients only)",
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="this instance's cost profile for a Conductor (from `hetserve profile`; without "
        "it, a quick one is measured when the Conductor first asks)",
    )
    g.add_argument(
        "--log-requests",
        default=None,
        metavar="FILE",
        help="append one line per finished request (hetserve sim's trace format: arrival, "
        "lengths, block hashes, TTFT, TBT); `hetserve sim --trace FILE` replays it",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no access line per request (route, status, tokens, TTFT, duration)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls are read from replies: hermes, llama3_json, deepseek_v3, kimi_k2, "
        "glm45, openai (default: from the model's chat template)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        help="how thinking is split from answers: qwen3, deepseek_r1, glm45, kimi_k2, openai "
        "(default: from the model's chat template)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own chat_template (in the templates' sandbox); refused "
        "by default, as vLLM does",
    )
    g.add_argument(
        "--save-routing-stats",
        default=None,
        metavar="FILE",
        help="accumulate expert routing counts and save them here on shutdown",
    )
    s.set_defaults(func=serve)


def check_port(host: str, port: int) -> None:
    """Before the model loads (minutes for a large one): a port that cannot be bound is a
    one-line error now, not a traceback after loading."""
    import socket

    if not 0 < port < 65536:
        raise InvalidInputError(f"--port must be in 1..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as exc:
            why = "in use" if exc.errno == 98 else exc.strerror
            raise InvalidInputError(
                f"cannot listen on {host}:{port} ({why}); pick another --port"
            ) from None


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or envs.api_key()
    if not is_loopback(args.host) and not api_key:
        raise InvalidInputError(
            f"refusing to bind {args.host} without an API key; pass --api-key (or set "
            "HETSERVE_API_KEY), or bind 127.0.0.1"
        )
    if args.max_request_mb <= 0:
        raise InvalidInputError("--max-request-mb must be positive")
    check_port(args.host, args.port)
    check_output(args.save_routing_stats, "--save-routing-stats")
    profile = None
    if args.profile is not None:
        from hetserve.disagg.costs import load_profile, profile_to_dict

        try:
            profile = profile_to_dict(load_profile(args.profile)[0])
        except ValueError as exc:
            raise InvalidInputError(f"--profile {args.profile}: {exc}") from None
    from hetserve.server.chat import check_parser_names

    try:
        check_parser_names(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    import uvicorn

    from hetserve.config import EngineConfig
    from hetserve.engine.async_llm import AsyncLLM
    from hetserve.server.app import create_app

    args.record_routing_stats = bool(args.save_routing_stats)
    args.kv_events_token = api_key  # the KV event sockets' shared token beyond loopback
    args.enable_lora = args.enable_lora or args.enable_lora_runtime_updates
    name = args.served_model_name or (
        args.model.rstrip("/").split("/")[-1] if args.model else "hetserve-demo"
    )
    config = EngineConfig.from_args(args)
    if name in dict(config.lora.lora_modules):
        raise InvalidInputError(
            f"LoRA adapter name {name!r} is the base model's served name; rename the adapter "
            "(or pass --served-model-name)"
        )
    engine = AsyncLLM(config)
    limit = int(args.max_request_mb * (1 << 20))
    app = create_app(
        engine,
        name,
        api_key=api_key,
        max_body_bytes=limit,
        lora_runtime_updates=args.enable_lora_runtime_updates,
        profile=profile,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        log_requests=not args.disable_log_requests,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    logger = None
    if args.log_requests is not None:
        from hetserve.server.request_log import RequestLogger

        core = engine.engine
        logger = RequestLogger(args.log_requests, core.kv.block_size, core.kv.hash_seed)
        engine.observers.append(logger.observe)
    print(engine.placement_summary, flush=True)
    if getattr(engine, "memory", None) is not None:
        print(engine.memory.line(), flush=True)
    if engine.kv_summary:
        print(engine.kv_summary, flush=True)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    if engine.handoff_address:
        print(f"receiving KV hand-offs on {engine.handoff_address}", flush=True)
    events = engine.kv_info()["kv_events"]
    if isinstance(events, dict):
        print(f"KV events on {events['endpoint']} (replay {events['replay_endpoint']})")
    for adapter, path in engine.lora_adapters().items():
        print(f"  LoRA adapter {adapter!r} from {path}", flush=True)
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=2,
        )
    finally:
        engine.shutdown()
        if logger is not None:
            logger.close()
        stats = engine.routing_stats()
        if stats is not None:
            stats.save(args.save_routing_stats)
            print(f"routing statistics saved to {args.save_routing_stats}")
    return 0
