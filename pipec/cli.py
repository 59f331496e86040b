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
import contextlib
import errno
import gc
import importlib
import io
import os
import sys

from pipec.errors import PipecError

# Errors of a write to standard output that mean it cannot take any more: the
# disk is full, the descriptor is closed or read-only, the reader went away.
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EBADF, errno.EPIPE, errno.EIO, errno.EDQUOT, errno.EFBIG}

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
    "profile",
    "partition",
    "import_torch",
    "rings",
    "attention",
    "search",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error exits 1 like every other user error, and
    help or version text that standard output cannot take is reported (argparse
    drops the write error, so `pipec --help > /dev/full` would exit 0)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(1)

    def _print_message(self, message: str, file=None) -> None:  # argparse's hook for help, usage, version
        if message:
            (file or sys.stderr).write(message)


def version() -> str:
    """pipec's version: the installed package's (importlib.metadata), else the source tree's pyproject.toml."""
    try:
        from importlib.metadata import PackageNotFoundError, version as installed

        try:
            return installed("pipec")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover - Python >= 3.8 has it
        pass
    import os
    import re

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject, encoding="utf-8") as handle:
            found = re.search(r'^version\s*=\s*"([^"]+)"', handle.read(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else "unknown"


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up when asked for, not when the parser is built (finding
    the installed package's costs ~20 ms of imports, a tenth of a ``pipec check``)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show pipec's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(f"pipec {version()}\n", sys.stdout)  # on stdout, as argparse's own action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipec", description="Compile, check, simulate and run pipeline schedules.")
    parser.add_argument("--version", action=_VersionAction)
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
    if sys.stdout is None:  # started with standard output closed (`pipec list >&-`)
        _close_stdout_safely()
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, where a full or closed standard output can still be reported
    except SystemExit:  # argparse's --help, --version and usage errors print too
        if not _flush_stdout():
            raise SystemExit(1) from None
        raise
    except (BrokenPipeError, OSError) as error:
        if not _output_failed(error):
            raise
        status = 1
    return status


def _run(argv: list[str] | None) -> int:
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
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


class _ClosedOutput(io.TextIOBase):
    """Standard output when the process was started without one: every write fails as a closed descriptor's would."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not text:
            return 0
        raise OSError(errno.EBADF, "it is closed")


def _close_stdout_safely() -> None:
    """Keep descriptor 1 taken (by the null device), so that no file pipec opens, nor a worker's output,
    lands on it; writes to ``sys.stdout`` fail, and are reported as such."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
    sys.stdout = _ClosedOutput()


def _flush_stdout() -> bool:
    """Flush standard output; False (and the message of ``_output_failed``) when it cannot take it."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError) as error:
        if not _output_failed(error):
            raise
        return False
    return True


def _output_failed(error: OSError) -> bool:
    """Report that standard output failed (full, closed, a reader gone), if that is what ``error`` is.

    Writes one line to standard error (when it can), and points ``sys.stdout``
    at the null device, so that the interpreter's own flush at exit does not
    fail again with a traceback. Returns False for an OSError that is not about
    standard output (a bug elsewhere: it is raised again).
    """
    stdout = sys.stdout
    try:
        descriptor = stdout.fileno()
    except (AttributeError, OSError, ValueError):
        descriptor = None
    if not isinstance(error, BrokenPipeError) and error.errno not in _OUTPUT_ERRNOS:
        return False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if descriptor is not None:
            os.dup2(devnull, descriptor)  # whatever is still buffered goes nowhere
        os.close(devnull)
    except OSError:
        pass
    sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    if isinstance(error, BrokenPipeError):
        return True  # the reader is gone (``pipec list | head``): nothing to say to anyone
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"pipec: cannot write to standard output: {error.strerror or error}\n")
        sys.stderr.flush()
    return True


if __name__ == "__main__":
    raise SystemExit(main())
