"""The ``pipec`` command line.

Each subcommand lives in its own module under ``pipec.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function
``(args) -> int``. This module only wires them together and turns every
``PipecError`` into a printed message and exit status 1: a user's mistake never
shows a Python traceback.
"""
from __future__ import annotations

import argparse
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
