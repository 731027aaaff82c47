"""hetserve: serve and fine-tune Mixture-of-Experts LLMs on CPUs and accelerators.

One subcommand group per module of `hetserve/entrypoints/`.
A command module exposes `register(subparsers)`; it must import only light modules at top level
(torch and models are imported inside the handlers) so `hetserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hetserve.errors import HetserveError

COMMAND_MODULES = [
    "hetserve.entrypoints.models",  # models make-tiny, convert
    "hetserve.entrypoints.generate",  # generate
    "hetserve.entrypoints.chat",  # chat
    "hetserve.entrypoints.serve",  # serve
    "hetserve.entrypoints.bench",  # bench ...
    "hetserve.entrypoints.store",  # store master | node
    "hetserve.entrypoints.calibrate",  # calibrate (routing statistics for --gpu-experts)
    "hetserve.entrypoints.finetune",  # finetune CONFIG.yaml
    "hetserve.entrypoints.export",  # export (a LoRA adapter merged into full weights)
    "hetserve.entrypoints.profile",  # profile (prefill/decode costs for the Conductor)
    "hetserve.entrypoints.conductor",  # conductor (a prefill/decode cluster's front door)
    "hetserve.entrypoints.cluster",  # cluster up (store, instances and Conductor here)
    "hetserve.entrypoints.sim",  # sim (cluster simulator over a request trace)
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, as argparse does, plus a hint
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except HetserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
