"""`python -m hetserve.store master | node ...`: the pool services alone, as `hetserve store`
runs them, without building the whole CLI (other command groups import torch, ~3 s of start-up
per process; tests and benches start several nodes)."""

from __future__ import annotations

import argparse
import sys

from hetserve.errors import HetserveError
from hetserve.store.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except HetserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
