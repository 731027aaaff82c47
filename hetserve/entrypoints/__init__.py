"""Command-line front ends: one module per `hetserve` command group, each with `register(sub)`
(the argparse subcommands it adds) and handlers that import the heavy parts (torch, the engine,
models) only when they run. `hetserve/cli.py` lists them. They sit above everything else: they
import the engine, server, store, bench and finetune packages; nothing imports them.

Failure contract (every command): a user mistake is one line on stderr naming the problem and
the fix, exit code 2 (`HetserveError` caught in `cli.main`), never a traceback.
An OSError that names a path is one line too; a path a command writes only after its work
(a profile, plots, routing statistics) is checked before the work with `check_output`.
"""

from __future__ import annotations

from pathlib import Path

from hetserve.errors import InvalidInputError


def check_output(
    path: str | None, flag: str, directory: bool = False, make_parent: bool = False
) -> None:
    """Before the work: `path` (a file, or a `directory` made if missing) can be written
    there; a one-line error naming `flag` otherwise, not an OSError after minutes of work.
    `make_parent`: a file's missing directory is made now (the benches' JSON)."""
    if path is None:
        return
    p = Path(path)
    if directory:
        if p.exists() and not p.is_dir():
            raise InvalidInputError(f"{flag} {path}: is a file; give a directory")
        return
    if p.is_dir():
        raise InvalidInputError(f"{flag} {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if make_parent and not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidInputError(
                f"{flag} {path}: cannot make directory {str(parent)!r} ({exc.strerror or exc})"
            ) from None
    if not parent.is_dir():
        raise InvalidInputError(f"{flag} {path}: directory {str(parent)!r} does not exist")
