"""`hetserve conductor`: the cluster's front door (`disagg/conductor.py`): an OpenAI-compatible
server that routes each request to prefill and decode instances by predicted time to first
token and refuses early (429) what would miss its SLO."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetserve import envs
from hetserve.errors import InvalidInputError


def register(sub) -> None:
    c = sub.add_parser(
        "conductor",
        help="route requests across prefill/decode instances (a cluster's front door)",
        description=__doc__,
    )
    c.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances")
    c.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances")
    c.add_argument(
        "--both", nargs="+", default=[], metavar="URL", help="colocated instances (role both)"
    )
    c.add_argument(
        "--model",
        default=None,
        help="the instances' model directory, for its tokenizer (default: the one they serve)",
    )
    c.add_argument("--served-model-name", default=None)
    from hetserve.disagg.policy import ADMISSIONS, POLICIES

    c.add_argument("--policy", default="kvcentric", choices=POLICIES)
    c.add_argument("--admission", default="none", choices=ADMISSIONS)
    c.add_argument("--slo-ttft-ms", type=float, default=None)
    c.add_argument("--slo-tbt-ms", type=float, default=None)
    c.add_argument("--handoff-path", default="direct", choices=("direct", "store", "mooncake"))
    c.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    c.add_argument("--port", type=int, default=8000)
    c.add_argument(
        "--api-key",
        default=None,
        help="require this bearer token from clients; the instances are called with "
        "HETSERVE_API_KEY, else with this key",
    )
    c.add_argument(
        "--admin-key",
        default=None,
        help="the key that may add and remove instances while it runs (/internal/instances, "
        "/add_worker, /remove_worker; or HETSERVE_ADMIN_KEY); without one, only callers on "
        "this machine may",
    )
    from hetserve.entrypoints.serve import LOG_LEVELS

    c.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    c.add_argument(
        "--log-requests",
        default=None,
        metavar="FILE",
        help="one line per request in hetserve sim's trace format (replay it with hetserve sim)",
    )
    c.add_argument(
        "--log-decisions",
        default=None,
        metavar="FILE",
        help="every routing decision with the cluster state it saw (replayable)",
    )
    c.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hetserve.entrypoints.serve import check_port, is_loopback

    check_port(args.host, args.port)  # before any instance is asked

    api_key = args.api_key or envs.api_key()
    if not is_loopback(args.host) and not api_key:
        raise InvalidInputError(
            f"refusing to bind {args.host} without an API key; pass --api-key (or set "
            "HETSERVE_API_KEY), or bind 127.0.0.1"
        )
    if not (args.prefill and args.decode) and not args.both:
        raise InvalidInputError(
            "give --prefill and --decode instances (disaggregated), or --both instances"
        )
    for flag, given in (("--prefill", args.prefill), ("--decode", args.decode),
                        ("--both", args.both)):  # fmt: skip
        for url in given:
            if not url.startswith(("http://", "https://")):
                raise InvalidInputError(f"{flag} wants an instance's http://HOST:PORT, got {url!r}")
    for ms in (args.slo_ttft_ms, args.slo_tbt_ms):
        if ms is not None and ms <= 0:
            raise InvalidInputError("SLOs must be positive milliseconds")
    if args.admission == "predictive" and args.slo_ttft_ms is None and args.slo_tbt_ms is None:
        raise InvalidInputError("--admission predictive needs --slo-ttft-ms or --slo-tbt-ms")
    import asyncio

    asyncio.run(_serve(args, api_key))
    return 0


def served_model(
    model: str | None, served_name: str | None, card: Mapping[str, Any]
) -> tuple[str | None, str]:
    """The Conductor's tokenizer (a model directory or file; None: the demo model) and the
    model name it lists: by default the instances' own (`card`: their /v1/models entry), for
    clients send the name listed and the instances refuse any other, and a prompt hashed with
    another tokenizer than theirs would never find their cached prefixes."""
    root = card.get("root")
    if model is None and isinstance(root, str):
        if not Path(root).exists():
            raise InvalidInputError(
                f"the instances serve {root}, which is not on this machine; pass --model with "
                "a copy of it (the Conductor tokenizes prompts as the instances do)"
            )
        model = root
    fallback = model.rstrip("/").split("/")[-1] if model else "hetserve-demo"
    listed = card.get("id")
    return model, served_name or (listed if isinstance(listed, str) else fallback)


def _alias(name: str, cluster) -> tuple[str, str] | None:
    """(listed, served) where the Conductor lists the model under another name than the
    instances serve it (`--served-model-name`), else None."""
    served = cluster.model_card.get("id")
    return (name, served) if isinstance(served, str) and served != name else None


async def _serve(args: argparse.Namespace, api_key: str | None) -> None:
    import asyncio

    import uvicorn

    from hetserve.config import Role
    from hetserve.disagg.conductor import Conductor, ConductorConfig, OtherAPI
    from hetserve.disagg.conductor_responses import stream_error as responses_stream_error
    from hetserve.disagg.instances import Cluster, Instance
    from hetserve.disagg.kv_subscriber import KVEventSubscriber
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.engine.setup import resolve_model_dir
    from hetserve.model.tokenizer import Tokenizer
    from hetserve.server.anthropic import anthropic_error, anthropic_stream_error
    from hetserve.server.anthropic_input import chat_body as anthropic_chat_body
    from hetserve.server.chat import chat_prompt_text
    from hetserve.server.conductor_app import create_conductor_app
    from hetserve.server.ollama import ollama_error, ollama_stream_error
    from hetserve.server.ollama_input import conductor_chat_body
    from hetserve.server.responses_input import stateless_chat_body

    urls = [(u.rstrip("/"), Role.PREFILL) for u in args.prefill]
    urls += [(u.rstrip("/"), Role.DECODE) for u in args.decode]
    urls += [(u.rstrip("/"), Role.BOTH) for u in args.both]
    # What the instances ask of callers, if anything: the same key as the Conductor's
    # clients', unless HETSERVE_API_KEY names theirs (`serve --api-key K` and
    # `conductor --api-key K` then make one cluster).
    key = envs.api_key() or api_key
    cluster = Cluster(urls, {"Authorization": f"Bearer {key}"} if key else None,
                      handoff_path=args.handoff_path)  # fmt: skip
    index = KVEventSubscriber()  # which instance holds which prefix, from their KV events

    async def follow(inst: Instance) -> None:
        try:
            await asyncio.to_thread(index.add, inst.name, inst.url, key)
        except ConnectionError as exc:  # routed as if it held nothing
            print(f"no KV index of {inst.name}: {exc}", flush=True)

    cluster.on_join = follow  # an instance that was not up at start (or added), once it answers
    cluster.on_remove = index.remove  # one removed while running (`/internal/instances`)
    try:
        await cluster.start()
        model, name = served_model(args.model, args.served_model_name, cluster.model_card)
    except BaseException:
        index.close()
        await cluster.close()
        raise
    router = Router(
        RouterConfig(
            policy=args.policy,
            admission=args.admission,
            slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
            slo_tbt_s=None if args.slo_tbt_ms is None else args.slo_tbt_ms / 1e3,
        )
    )
    model_dir = resolve_model_dir(model)
    for inst in list(cluster.instances.values()):  # those that answered at start
        await follow(inst)
    cluster.on_health = lambda name, up: index.rejoined(name) if up else None
    conductor = Conductor(
        cluster,
        router,
        Tokenizer(model_dir),
        ConductorConfig(args.handoff_path, api_key=api_key, model_alias=_alias(name, cluster),
                        admin_key=args.admin_key or envs.admin_key()),  # fmt: skip
        holdings=index.holdings,
    )
    conductor.index_blocks = index.block_counts
    conductor.render_chat = functools.partial(chat_prompt_text, conductor.tok)
    conductor.apis["/v1/responses"] = OtherAPI(  # OpenAI's; stateful ones go to their holder
        stateless_chat_body, lambda body: body, responses_stream_error
    )
    for path, generate in (("/api/chat", False), ("/api/generate", True)):  # Ollama's
        conductor.apis[path] = OtherAPI(
            functools.partial(conductor_chat_body, generate=generate), ollama_error,
            ollama_stream_error,
        )  # fmt: skip
    conductor.apis["/v1/messages"] = OtherAPI(  # Anthropic's, as the instances translate it
        functools.partial(anthropic_chat_body, thinking_budget=False), anthropic_error,
        anthropic_stream_error,
    )  # fmt: skip
    if args.log_requests:
        from hetserve.core.trace_record import RequestLogWriter

        conductor.request_log = RequestLogWriter(args.log_requests)
    if args.log_decisions:
        from hetserve.sim.decisions import DecisionLog

        conductor.decision_log = DecisionLog(args.log_decisions, router.config)
    app = create_conductor_app(conductor, name)
    many = "instance" if len(urls) == 1 else "instances"
    print(f"conductor for {len(urls)} {many} on http://{args.host}:{args.port}/v1", flush=True)
    # A stop waits for what is in flight at most this long (then its clients get a 503). No
    # lifespan: the app has no start-up work, and a forced stop cancelled its task with a
    # traceback.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, lifespan="off")  # fmt: skip
    try:
        await uvicorn.Server(config).serve()
    finally:
        conductor.closing = True  # what is still in flight is answered 503, not 502
        index.close()
        await cluster.close()
