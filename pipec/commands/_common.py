"""Arguments and helpers shared by the commands that take a schedule target."""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from typing import TextIO

from pipec.compiler.defines import parse_defines  # one definition, shared with the runtime's worker
from pipec.compiler.guarded_read import count_arg, quote
from pipec.compiler.trace_events import recorded
from pipec.errors import NumberLimitError, SourceError, SourceErrors, UsageError, printable_name


def add_target_arguments(parser: argparse.ArgumentParser, costs: bool = True) -> None:
    parser.add_argument("target", metavar="TARGET", help="a .pipe file, or a shipped schedule's name (see `pipec list`)")
    parser.add_argument(
        "-D", dest="defines", action="append", default=[], metavar="NAME=VALUE", help="set a schedule parameter (repeatable)"
    )
    if costs:
        parser.add_argument("--costs", metavar="FILE", help="a JSON cost file (default: unit costs F=1 B=2 I=W=1)")
    parser.add_argument("--budget", type=count_arg, metavar="N", help="fail if a rank holds more than N chunk activations")
    parser.add_argument(
        "--budget-bytes", dest="budget_bytes", action="append", default=[], metavar="CLASS=BYTES",
        help="fail if a rank holds more than BYTES bytes of values of size class CLASS (activation, weight, shard, kv, "
             "stats) at once; the cost file's \"sizes\" gives the bytes of one value (repeatable)",
    )


def load_costs(args):
    if not getattr(args, "costs", None):
        return None
    from pipec.compiler.costs import load_costs as load

    return load(args.costs)


_BYTES = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


def parse_byte_budget(items) -> dict:
    """``--budget-bytes CLASS=BYTES`` values as size class -> bytes (an int, or a float for a decimal).

    Raises:
        UsageError: not ``CLASS=BYTES``, an unknown size class, a class given
            twice, or BYTES not a plain non-negative integer or decimal.
    """
    from pipec.compiler.ops import SIZE_CLASSES

    budget: dict = {}
    for item in items:
        size_class, sep, text = item.partition("=")
        size_class, text = size_class.strip(), text.strip()
        if not sep or not size_class:
            raise UsageError(f"--budget-bytes expects CLASS=BYTES, got '{item}'")
        if size_class not in SIZE_CLASSES:
            raise UsageError(f"--budget-bytes: unknown size class '{size_class}' (expected one of {', '.join(SIZE_CLASSES)})")
        if size_class in budget:
            raise UsageError(f"--budget-bytes gives '{size_class}' twice")
        if not _BYTES.fullmatch(text):
            raise UsageError(f"--budget-bytes {size_class}: expected a non-negative integer or decimal number of bytes, "
                             f"got '{text}'")
        budget[size_class] = _byte_count(text, size_class)
    return budget


def _byte_count(text: str, size_class: str):
    """A ``--budget-bytes`` value (``_BYTES``-shaped) as an int below 2^63, or a decimal of at most 40
    characters below 2^63 too (the guarded reader's ``plain_int`` and ``plain_float``): a budget is compared
    with peaks in bytes, which stay within pipec's integer range."""
    from pipec.compiler.guarded_read import INT_LIMIT, INT_LIMIT_TEXT, is_plain_int, plain_float, plain_int

    what = f"--budget-bytes {size_class}"
    if is_plain_int(text):
        return plain_int(text, what)
    value = plain_float(text, what)
    if value >= INT_LIMIT:
        raise UsageError(f"{what}: {quote(text, 40)} is past pipec's integer range (below {INT_LIMIT_TEXT} bytes)")
    return value


def byte_budget_from_args(args, costs) -> dict | None:
    """The ``--budget-bytes`` budget (None when not given), each of its classes sized by the cost file.

    Raises:
        UsageError: a bad ``--budget-bytes``, or a class the cost file gives no size for (``shard``: nor a
            ``weight`` size to derive it from).
    """
    from pipec.compiler.placed_memory import may_size

    budget = parse_byte_budget(getattr(args, "budget_bytes", None) or [])
    if not budget:
        return None
    sizes = costs.sizes if costs is not None else {}
    for size_class in budget:
        if not may_size(size_class, sizes):
            raise UsageError(f"a byte budget for '{size_class}' needs its size: "
                             f'add "sizes": {{"{size_class}": BYTES}} to the cost file (--costs)')
    return budget


def compile_from_args(args, costs=None):
    """Compile and check the target of ``args`` (``--costs``, ``--budget``, ``--budget-bytes``) with the API.

    Args:
        args: the parsed command line.
        costs: the cost model, when the caller has loaded it already; else ``--costs`` is read.
    Returns:
        the checked ``pipec.api.Program``.
    """
    from pipec.api import compile as compile_program

    parse_byte_budget(getattr(args, "budget_bytes", None) or [])  # a mistake here is named before the cost file is read
    if costs is None:
        costs = load_costs(args)
    return compile_program(
        args.target, parse_defines(args.defines), costs=costs, memory_budget=getattr(args, "budget", None),
        byte_budget=byte_budget_from_args(args, costs),
    )


def is_torch_csv(target: str) -> bool:
    """Whether TARGET is a torch.distributed.pipelining schedule CSV (``pipec compile --format torch-csv``)."""
    from pipec.compiler.guarded_read import looks_like_torch_csv

    return looks_like_torch_csv(target)


def imported_program(target: str, defines: dict[str, str]):
    """A torch schedule CSV as a program, completed with communication when it has none, unchecked.

    Returns:
        (program, the semantics to check it under: "async" for a CSV with communication, as torch's
        runtime runs it, else "rendezvous"; ``compiler.import_torch.complete_imported``).
    Raises:
        UsageError: -D given (a CSV has no parameters), or the file cannot be read.
        ProgramError: the CSV is not a schedule.
    """
    from pipec.compiler.guarded_read import TORCH_CSV, read_text
    from pipec.compiler.import_torch import complete_imported, read_torch_csv

    if defines:
        raise UsageError(f"-D sets parameters of a .pipe schedule; the torch schedule CSV '{target}' has none")
    return complete_imported(*read_torch_csv(read_text(target, TORCH_CSV), source=target))


def checked_import(target: str, defines: dict[str, str], **check_options):
    """``imported_program``'s program, proved safe (``check_all`` with ``check_options``: budgets, sizes)."""
    from pipec.compiler.checks import check_all

    program, semantics = imported_program(target, defines)
    check_all(program, semantics=semantics, **check_options)
    return program


def number_text(value) -> str:
    """A time or count as a table shows it: an integral value as an integer, else four significant digits."""
    return str(int(value)) if float(value).is_integer() else f"{float(value):.4g}"


_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(nbytes) -> str:
    """``nbytes`` in binary units, to four significant digits: ``16 MiB``, ``114.4 MiB``, ``0 B``."""
    value, unit = nbytes, 0
    while True:
        text = str(int(value)) if float(value).is_integer() else f"{value:.4g}"
        if float(text) < 1024 or unit == len(_BYTE_UNITS) - 1:
            return f"{text} {_BYTE_UNITS[unit]}"
        value, unit = value / 1024, unit + 1


def describe_peak_bytes(peaks) -> str:
    """One rank's peak bytes per size class: ``activation 16 MiB, weight 0 B``."""
    return ", ".join(f"{size_class} {human_bytes(nbytes)}" for size_class, nbytes in peaks.items())


def write_output(text: str, path: str | None) -> None:
    """Write ``text`` (a newline added if missing) to standard output, or replace ``path`` atomically.

    Raises:
        UsageError: the file cannot be written; the old one is left as it was.
    """
    with atomic_output(path) as out:
        out.write(text if text.endswith("\n") else text + "\n")


@contextlib.contextmanager
def atomic_output(path: str | None) -> Iterator[TextIO]:
    """A text stream for a command's output: standard output, or ``path`` replaced atomically
    (``compiler.atomic_write.atomic_writer``: the old file stays whole until the new one is).

    Args:
        path: the file to write; None or ``-`` for standard output.
    Yields:
        the stream to write to (a streamed producer writes straight into it).
    Raises:
        UsageError: the file cannot be written (its folder is missing, not
            writable, the disk is full); the old file is left as it was.
    """
    if path in (None, "-"):
        yield sys.stdout
        sys.stdout.flush()
        return
    from pipec.compiler.atomic_write import atomic_writer

    with atomic_writer(path) as out:
        yield out


def dump_json(data, what: str = "the JSON output") -> str:
    """``data`` as indented JSON, which never holds ``Infinity`` or ``NaN`` (they are not JSON, and pipec's own
    reader refuses them): the totals are checked where they are formed (``guarded_read.checked_total``), and
    a number that is not finite all the same is refused here, before anything is written.

    Raises:
        NumberLimitError: ``data`` holds a float that is not finite, naming ``what``.
    """
    try:
        return json.dumps(data, indent=2, allow_nan=False)
    except ValueError:
        raise NumberLimitError(f"{what} holds a number that is not finite (inf or nan), which JSON cannot carry; "
                               "nothing was written") from None


def describe_params(params: dict) -> str:
    from pipec.compiler.defines import params_text

    return params_text(params)


def target_of_run(args, trace, command: str) -> tuple[str, dict[str, str]]:
    """TARGET and the -D values; without TARGET, what the trace of a run (``pipec run --trace``) records:
    its target (a file's absolute path, or a shipped name) and parameters, -D values on top."""
    defines = parse_defines(args.defines)
    if args.target is not None:
        return args.target, defines
    if trace is None:
        raise UsageError(f"{command} needs TARGET (a .pipe file, a shipped schedule or a program .json)")
    name = recorded(trace, "schedule")
    if name is None:
        raise UsageError(f"'{args.trace}' does not name its schedule; give TARGET")
    params = recorded(trace, "params", dict) or {}
    merged = {str(key): str(value) for key, value in params.items()}
    merged.update(defines)
    ran = recorded(trace, "target")  # written since traces record it; older ones name the schedule only
    if ran is None:
        return _shipped_target_named(name, args.trace), merged
    from pipec.compiler.driver import load_target

    try:
        load_target(ran)
    except UsageError as error:
        raise UsageError(f"'{args.trace}' ran {quote(ran)}, which cannot be read now ({error}); give TARGET") from None
    return ran, merged


@contextlib.contextmanager
def named_by_trace(trace_path: str, target: str, taken: bool) -> Iterator[None]:
    """Compile (or read) a target that the trace ``trace_path`` named, quoting nothing of it.

    A trace is a file a user hands pipec; the target it records may be any file. A source error
    prints a line of its file with a caret, so a trace naming ``/etc/passwd`` would have pipec
    print a line of that: an error of the target read here is reported by its location and kind
    only, with the trace named (``taken`` False: TARGET was given, errors as always).

    Raises:
        UsageError: ``'TRACE' ran TARGET, which does not compile now (FILE:LINE:COL: a parse error); give TARGET``.
    """
    if not taken:
        yield
        return
    try:
        yield
    except (SourceError, SourceErrors) as error:
        first = error.errors[0] if isinstance(error, SourceErrors) else error
        span = first.span
        where = f"{printable_name(span.file)}:{span.line}:{span.col}: " if span is not None else ""
        kind = type(first).__name__.replace("Error", " error").lower()
        raise UsageError(f"'{trace_path}' ran {quote(target)}, which does not compile now ({where}a {kind}; "
                         "its text is not shown, as the trace named it); give TARGET") from None


def _shipped_target_named(name: str, trace_path: str) -> str:
    """The shipped target that defines schedule ``name`` (a file stem, or ``path:name``)."""
    from pipec.compiler.driver import load_target, shipped_schedules
    from pipec.dsl import parse

    shipped = shipped_schedules()
    if name in shipped:
        return name
    for stem, file in shipped.items():
        path, source, _ = load_target(stem)
        if parse(source, path).schedule(name) is not None:
            return f"{file}:{name}"
    raise UsageError(f"'{trace_path}' ran schedule {quote(name)}, which no shipped file defines; give TARGET")


def read_json(path: str, what: str):
    """The parsed JSON file ``path`` (``what``: "trace" or "program"), through the one guarded reader.

    Raises:
        UsageError: not a regular file, over the size limit of its kind
            (``guarded_read.TRACE`` / ``PROGRAM``), not UTF-8, not JSON, or
            JSON with NaN, Infinity, a number out of range or nesting too deep.
    """
    from pipec.compiler import guarded_read

    kind = guarded_read.PROGRAM if what == "program" else guarded_read.TRACE
    return guarded_read.read_json(path, kind)
