"""`hetserve store master | node`: run the pool service's processes.

`python -m hetserve.entrypoints.store master | node ...` runs the same without building the
whole CLI (other command groups import torch, ~3 s of start-up per process; tests and benches
start several nodes).

Both bind 127.0.0.1 unless told otherwise; binding any other address needs a shared token
(`--token` or HETSERVE_STORE_TOKEN) that every node and client must then present.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from hetserve.errors import HetserveError, InvalidInputError

if TYPE_CHECKING:  # generic only in typeshed, not at run time
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


class _Service(Protocol):
    port: int

    def start(self) -> object: ...

    def close(self) -> None: ...


def register(sub: Subparsers) -> None:  # what add_subparsers returns
    p = sub.add_parser("store", help="KV store pool service (master, node)")
    ssub = p.add_subparsers(dest="store_cmd", metavar="ROLE")
    ssub.required = True

    m = ssub.add_parser("master", help="metadata service of the pool")
    _common(m, default_port=7600)
    m.add_argument(
        "--node-timeout",
        type=float,
        default=3.0,
        help="seconds without heartbeat before a node is declared dead",
    )
    m.add_argument("--max-value", default="1G", help="largest value accepted (e.g. 256M)")
    m.add_argument(
        "--watermarks",
        default="0.9,0.8",
        help="evict LRU objects from HIGH down to LOW fraction of capacity",
    )
    m.set_defaults(func=_run_master)

    n = ssub.add_parser("node", help="contribute DRAM (and SSD) to the pool")
    _common(n, default_port=0)
    n.add_argument("--master", default="127.0.0.1:7600", help="master HOST:PORT")
    n.add_argument("--dram", default="1G", help="DRAM segment size (e.g. 4G)")
    n.add_argument("--ssd-dir", default=None, help="directory for a file-backed SSD segment")
    n.add_argument("--ssd", default="0", help="SSD segment size (with --ssd-dir)")
    n.add_argument("--advertise", default=None, help="address clients use to reach this node")
    n.set_defaults(func=_run_node)


def _common(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=port, default=default_port)
    p.add_argument(
        "--token",
        default=None,
        help="shared secret; required to bind beyond loopback (or HETSERVE_STORE_TOKEN)",
    )
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"))  # fmt: skip


def port(text: str) -> int:
    """A TCP port (0: any free one), for argparse."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(text)
    return port


def _token(args: argparse.Namespace) -> str:
    from hetserve.store.registry import env_token

    return str(args.token) if args.token is not None else env_token()


def _serve_until_signal(service: _Service) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service.start()
    print(f"ready on port {service.port}", flush=True)
    stop.wait()
    service.close()
    return 0


def _run_master(args: argparse.Namespace) -> int:
    from hetserve.store.pool.master import PoolMaster
    from hetserve.store.registry import parse_size

    logging.basicConfig(level=args.log_level.upper())
    token = _token(args)
    try:
        high, low = (float(x) for x in args.watermarks.split(","))
    except ValueError as exc:
        raise InvalidInputError(f"--watermarks wants HIGH,LOW, got {args.watermarks!r}") from exc
    if not 0 < low <= high <= 1:
        raise InvalidInputError(f"--watermarks need 0 < LOW <= HIGH <= 1, got {args.watermarks}")
    if not args.node_timeout > 0:  # also NaN
        raise InvalidInputError(f"--node-timeout must be > 0 seconds, got {args.node_timeout}")
    max_value = parse_size(args.max_value)
    if max_value < 1:
        raise InvalidInputError(f"--max-value must be at least 1 byte, got {args.max_value!r}")
    with _listening(args.host, args.port):
        master = PoolMaster(args.host, args.port, token, args.node_timeout, max_value,
                            (high, low))  # fmt: skip
    return _serve_until_signal(master)


def _run_node(args: argparse.Namespace) -> int:
    from hetserve.store.pool.node import PoolNode
    from hetserve.store.registry import parse_size

    logging.basicConfig(level=args.log_level.upper())
    token = _token(args)
    mhost, _, mport = args.master.rpartition(":")
    if not mhost or not mport.isdigit() or not 1 <= int(mport) <= 65535:
        raise InvalidInputError(f"--master wants HOST:PORT, got {args.master!r}")
    dram, ssd = parse_size(args.dram), parse_size(args.ssd)
    if ssd and args.ssd_dir is None:
        raise InvalidInputError("--ssd needs --ssd-dir DIR, the directory of its segment file")
    if args.ssd_dir is not None and not ssd:
        raise InvalidInputError("--ssd-dir needs --ssd SIZE (e.g. --ssd 16G)")
    if not dram and not ssd:
        raise InvalidInputError("the node would hold nothing: give --dram SIZE or --ssd SIZE")
    with _listening(args.host, args.port):
        node = PoolNode((mhost, int(mport)), dram, args.host, args.port, token, args.ssd_dir,
                        ssd, args.advertise)  # fmt: skip
    return _serve_until_signal(node)


@contextlib.contextmanager
def _listening(host: str, port: int) -> Iterator[None]:
    """A port that cannot be bound is one line naming the flag, as `serve`'s."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise
        why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise InvalidInputError(
            f"cannot listen on {host}:{port} ({why}); pick another --port or --host"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetserve.entrypoints.store")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except HetserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
