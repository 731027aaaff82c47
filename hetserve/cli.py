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

EXAMPLES = """examples:
  hetserve serve                         OpenAI and Ollama APIs on the built-in demo model
  hetserve serve --model DIR --port 8000 a Hugging Face checkpoint directory (or a .gguf)
  hetserve chat --url http://127.0.0.1:8000
  hetserve generate "Hello"
  hetserve bench serve --base-url http://127.0.0.1:8000 --model NAME

`hetserve COMMAND --help` shows a command's options."""

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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetserve")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hetserve",
        description="Serve and fine-tune Mixture-of-Experts LLMs on CPUs and accelerators.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hetserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _leaf(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command's own parser that `argv` names: its help is the one to point at."""
    for token in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            parser = subs[0].choices[token]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    args, unknown = parser.parse_known_args(given)
    if unknown:  # named by the command that did not take them, and its help
        _leaf(parser, given).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:  # bare `hetserve`: what it can do, not an error
        parser.print_help()
        return 0
    try:
        rc = args.func(args)
    except HetserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave cannot be read or written as asked
        if exc.filename is None:
            raise
        print(f"error: {exc.filename}: {exc.strerror or exc}; check the path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
