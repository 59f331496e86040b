"""The ``pipec`` command line.

Each subcommand lives in its own module under ``pipec.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function
``(args) -> int``. This module only wires them together and turns every
``PipecError`` into a printed message and exit status 1: a user's mistake never
shows a Python traceback.

It also owns the process's garbage-collector policy: library code only pauses
the collector around bulk passes (``compiler.gc_pause``); freezing long-lived
objects and turning the collector off are whole-process decisions, made here.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys

from pipec.errors import PipecError

# Subcommand modules, in the order ``pipec --help`` lists them.
COMMANDS = (
    "demo",
    "list",
    "check",
    "compile",
    "simulate",
    "render",
    "run",
    "costs",
    "import_torch",
    "rings",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error exits 1 like every other user error."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipec", description="Compile, check, simulate and run pipeline schedules.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"pipec.commands.{name}")
        except ModuleNotFoundError as missing:
            if missing.name == f"pipec.commands.{name}":
                continue  # a command still being built
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A command is one short process. What exists now (the modules, the
    # parsers) lives as long as it does: frozen, no collection walks it again.
    # What the command builds (programs of a few hundred thousand tuples,
    # timelines) holds no reference cycles, so a collection between two
    # passes would walk all of it and find nothing (at P=64, N=512 that is a
    # fifth of the compile): the collector stays off; reference counting frees
    # memory as before.
    gc.freeze()
    gc.disable()
    try:
        return int(args.func(args) or 0)
    except PipecError as error:
        sys.stderr.write(error.render().rstrip("\n") + "\n")
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
