"""Start the OpenAI server: build the engine from CLI arguments, check the bind is safe, run."""

from __future__ import annotations

import argparse
import ipaddress

from hetserve import envs
from hetserve.errors import InvalidInputError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_config(args: argparse.Namespace):
    from hetserve.config import CacheConfig, EngineConfig, SchedulerConfig

    try:
        return EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_kv_blocks,
                kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)) if args.kv_cache_gb else None,
                enable_prefix_caching=not args.no_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
            ),
            moe=moe_config(args),
        )
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


def moe_config(args: argparse.Namespace):
    from hetserve.config import MoEConfig

    return MoEConfig(
        max_deferred_experts_per_token=args.max_deferred_experts_per_token,
        placement=args.placement,
        gpu_experts=args.gpu_experts,
        routing_stats=args.routing_stats,
        cpu_threads=args.cpu_threads,
        record_routing_stats=bool(getattr(args, "save_routing_stats", None)),
    )


def add_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--placement",
        default=None,
        metavar="default|RULES.yaml",
        help="hybrid placement: 'default' puts routed experts on CPU (cpu-int8) and the rest "
        "on the engine device; or a YAML rules file",
    )
    p.add_argument(
        "--gpu-experts",
        type=int,
        default=0,
        help="keep the N most-routed experts of each layer on the engine device",
    )
    p.add_argument(
        "--routing-stats",
        default=None,
        metavar="FILE",
        help="routing statistics JSON (from `hetserve calibrate`)",
    )
    p.add_argument(
        "--cpu-threads", type=int, default=None, help="threads of the dedicated CPU-experts pool"
    )
    p.add_argument(
        "--max-deferred-experts-per-token",
        type=int,
        default=0,
        help="expert deferral: this many low-weight experts per token run one layer late",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    add_moe_args(p)


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or envs.api_key()
    if not is_loopback(args.host) and not api_key:
        raise InvalidInputError(
            f"refusing to bind {args.host} without an API key; pass --api-key (or set "
            "HETSERVE_API_KEY), or bind 127.0.0.1"
        )
    import uvicorn

    from hetserve.engine.async_llm import AsyncLLM
    from hetserve.server.app import create_app

    engine = AsyncLLM(engine_config(args))
    name = args.served_model_name or (
        args.model.rstrip("/").split("/")[-1] if args.model else "hetserve-demo"
    )
    app = create_app(engine, name, api_key=api_key)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
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
        stats = engine.routing_stats()
        if stats is not None:
            stats.save(args.save_routing_stats)
            print(f"routing statistics saved to {args.save_routing_stats}")
    return 0
