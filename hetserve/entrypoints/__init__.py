"""Command-line front ends: one module per `hetserve` command group, each with `register(sub)`
(the argparse subcommands it adds) and handlers that import the heavy parts (torch, the engine,
models) only when they run. `hetserve/cli.py` lists them. They sit above everything else: they
import the engine, server, store, bench and finetune packages; nothing imports them.

Failure contract (every command): a user mistake is one line on stderr naming the problem and
the fix, exit code 2 (`HetserveError` caught in `cli.main`), never a traceback.
"""
