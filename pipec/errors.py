"""One exception hierarchy for everything pipec reports to a user.

Two shapes of error exist, because a user can be wrong in two places:

* ``SourceError``: something in a ``.pipe`` file. It prints
  ``file:line:col: message``, the source line and a caret under the column.
* ``ProgramError``: something in a per-rank instruction list (compiled or
  imported). It prints ``rank R, step S: message`` and a bounded window of the
  per-rank grid with the failing step marked.

The CLI catches ``PipecError``, prints ``render()`` and exits 1; anything else
is a bug in pipec, never a user's mistake.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence


# Characters a message may not carry to a terminal as they are: C0 controls
# but newline and tab (a carriage return or an escape sequence in a file's text
# could overwrite what was printed, or print a fake line), DEL, C1 controls,
# the bidirectional overrides and isolates (text shown in another order than
# it is), and lone surrogates (undecodable bytes of a file name or a file).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` safe to show on a terminal: every character of ``_UNPRINTABLE`` as its Python escape
    (``\\r``, ``\\x1b``, ``\\u202e``, ``\\udcff``); newlines and tabs are kept.

    Every message pipec renders for a user goes through it (``PipecError.render``
    and its subclasses'), since messages quote what files hold: a trace's target,
    a CSV cell, a source line.
    """
    return _UNPRINTABLE.sub(_escape, text)


# A name is one line: it may not carry a newline or a tab either.
_UNPRINTABLE_IN_NAME = re.compile(_UNPRINTABLE.pattern[:-1] + "\n\t]")


def counted(number: int, noun: str) -> str:
    """``1 rank``, ``4 ranks``, ``2 microbatches``: a count and its noun, singular for one (every summary line
    pipec prints)."""
    if number == 1:
        return f"{number} {noun}"
    return f"{number} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def printable_name(text) -> str:
    """A name read from user data (a program file's name or parameter, an attention file's, a layer's), as
    every table and line pipec prints shows it: ``printable``, and newlines and tabs escaped too (a name is
    one line; a raw one could print a fake line of output). The one helper for every printer of such names."""
    return _UNPRINTABLE_IN_NAME.sub(_escape, str(text))


def _escape(match: re.Match) -> str:
    code = ord(match.group(0))
    return {0x0D: "\\r", 0x0A: "\\n", 0x09: "\\t"}.get(code) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


class PipecError(Exception):
    """Base of every error pipec reports to a user."""

    def render(self) -> str:
        """The message to print, unprintable characters escaped (``printable``)."""
        return printable(str(self))


class UsageError(PipecError):
    """Bad command-line input: unknown schedule, malformed -D, missing file."""


# ---------------------------------------------------------------- source errors


@dataclass(frozen=True)
class Span:
    """A place in a source file; lines and columns count from 1."""

    file: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0


class NoOrderFound(UsageError):
    """A search ended without an order (the time limit, or no order meets the limits)."""


class SourceError(PipecError):
    """An error located in a ``.pipe`` source file."""

    def __init__(self, message: str, span: Span | None = None, source: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span
        self.source = source

    def with_source(self, source: str) -> "SourceError":
        if self.source is None:
            self.source = source
        return self

    def render(self) -> str:
        if self.span is None:
            return printable(self.message)
        span = self.span
        head = printable(f"{span.file}:{span.line}:{span.col}: {self.message}")
        line_text = _source_line(self.source, span.line)
        if line_text is None:
            return head
        # the quoted line escaped, and the caret placed under the escaped text
        expanded = printable(line_text).expandtabs(4).rstrip("\n")
        prefix = printable(line_text[: max(span.col - 1, 0)]).expandtabs(4)
        width = 1
        if span.end_line == span.line and span.end_col > span.col:
            width = span.end_col - span.col
        width = max(1, min(width, max(len(expanded) - len(prefix), 1)))
        shown, column = _window(expanded, len(prefix))
        width = max(1, min(width, len(shown) - column))
        caret = " " * column + "^" + "~" * (width - 1)
        return f"{head}\n    {shown}\n    {caret}"

    def __str__(self) -> str:
        return self.render()


class ParseError(SourceError):
    """The text is not a ``.pipe`` program (grammar)."""


class ResolveError(SourceError):
    """An unknown name, a duplicate definition or a type mismatch."""


class EvalError(SourceError):
    """An expression could not be evaluated (division by zero, bad range)."""


class RequireError(SourceError):
    """A ``require`` constraint is false for the given parameters."""


class ScheduleError(SourceError):
    """The evaluated schedule is inconsistent (a stage with two homes, a task out of range)."""


class SourceErrors(SourceError):
    """Several source errors, collected and raised once: a ``SourceError`` located at the first of them, so
    that whoever catches source errors (the API's users) catches a file with several mistakes too.

    Attributes:
        errors: every error, in source order (at least one).
    """

    def __init__(self, errors: Sequence[SourceError]):
        self.errors = list(errors)
        if not self.errors:
            raise ValueError("SourceErrors needs at least one error")
        first = self.errors[0]
        super().__init__("\n".join(e.render() for e in self.errors), first.span, first.source)

    def with_source(self, source: str) -> "SourceErrors":
        for error in self.errors:
            error.with_source(source)
        self.source = self.source if self.source is not None else source
        return self

    def render(self) -> str:
        return "\n".join(e.render() for e in self.errors)


# The most characters of a source line an error quotes; a longer line (a
# generated or hostile file) is cut around the caret, so a message stays a
# few lines whatever the file.
_LINE_WINDOW = 120


def _window(line: str, column: int) -> tuple[str, int]:
    """``line`` cut to ``_LINE_WINDOW`` characters around ``column`` ("..." where cut), and the column in it."""
    if len(line) <= _LINE_WINDOW:
        return line, column
    start = max(0, min(column - _LINE_WINDOW // 3, len(line) - _LINE_WINDOW))
    left = "..." if start > 0 else ""
    right = "..." if start + _LINE_WINDOW < len(line) else ""
    return left + line[start:start + _LINE_WINDOW] + right, len(left) + column - start


def _source_line(source: str | None, line: int) -> str | None:
    if source is None or line < 1:
        return None
    lines = source.split("\n")  # as the parser counts lines: a \r or a form feed does not end one
    if line > len(lines):
        return None
    return lines[line - 1]


# --------------------------------------------------------------- program errors


class ProgramError(PipecError):
    """An error in a per-rank instruction list, located at (rank, step).

    ``grid`` is the program as text tokens, one list per rank; the rendering
    shows a bounded window of it around the failing step.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        step: int | None = None,
        grid: Sequence[Sequence[str]] | None = None,
        marks: Sequence[tuple[int, int]] = (),
    ):
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.step = step
        self.grid = grid
        # Extra cells to mark (a deadlock cycle marks every member).
        self.marks = list(marks)
        # What ``step`` is called in the head: a family whose schedules write steps of their own (a
        # sequence ring's ``at step``) calls the list index "instruction" and names its written step beside.
        self.index_word = "step"
        self.written_step: int | None = None

    def render(self) -> str:
        head = printable(self.message)
        if self.rank is not None and self.step is not None:
            written = "" if self.written_step is None else f" (at step {self.written_step})"
            head = f"rank {self.rank}, {self.index_word} {self.step}{written}: {head}"
        elif self.rank is not None:
            head = f"rank {self.rank}: {head}"
        if self.grid is None or self.rank is None or self.step is None:
            return head
        marks = [(self.rank, self.step)] + self.marks
        return head + "\n" + format_grid(self.grid, marks)

    def __str__(self) -> str:
        return self.render()


class WellFormedError(ProgramError):
    """A task is missing, duplicated, out of range or out of dependency order."""


class MatchError(ProgramError):
    """A send without its receive, or sends and receives in different orders."""


class DeadlockError(ProgramError):
    """The wait-for graph has a cycle; ``cycle`` lists (rank, step, waits-on text)."""

    def __init__(self, message, rank=None, step=None, grid=None, marks=(), cycle=()):
        super().__init__(message, rank, step, grid, marks)
        self.cycle = list(cycle)


class ConflictError(ProgramError):
    """Two computations in one slot, or a buffer overwritten while in flight."""


class BudgetError(ProgramError):
    """Peak memory above the given budget."""


class RouteError(ProgramError):
    """A weight or gradient not where it must be (weight passing): a task runs a layer whose
    weights this rank does not hold, a copy is dropped while its send is in flight, a
    gradient is added to while it travels, lost, or folded into its owner twice; for sequence
    rings the same of KV bundles and dK, dV partials."""


class CoverageError(ProgramError):
    """Attention blocks that do not cover the mask exactly once (sequence rings): a visible block
    never computed, one computed twice, a fully masked one computed, or a backward before its
    query's forward is complete."""


class VersionError(ProgramError):
    """Asynchronous training (optimizer updates in the order): a backward that would run on newer
    weights than its forward because its stage keeps too few versions, an update of a replicated
    stage, or a weight gradient that no update applies."""


class CostFileError(PipecError):
    """A cost file that cannot be used."""


class NumberLimitError(PipecError):
    """A number beyond what pipec computes with: one given to the API past the limits the guarded reader
    holds files to (``guarded_read.COST_LIMIT``), or a total formed from numbers read (a makespan, a busy
    time, peak bytes, a partition's stage time or memory) that overflows: a float that became infinite or
    not a number, an integer past pipec's range (below 2^63). The message names the file (and the key) the
    numbers came from where it is known."""


class ImportError_(ProgramError):
    """A torch CSV that cannot be read as a schedule."""


def format_grid(
    grid: Sequence[Sequence[str]],
    marks: Sequence[tuple[int, int]],
    before: int = 5,
    after: int = 5,
    max_ranks: int = 12,
) -> str:
    """Render a window of the per-rank grid around the marked cells.

    Args:
        grid: one list of instruction texts per rank.
        marks: (rank, step) cells to bracket; the first one centres the window.
    Returns:
        lines ``rank r | a b [c] d`` with ``...`` where the grid is cut.
    """
    if not grid:
        return ""
    focus_rank, focus_step = marks[0]
    marked = set(marks)
    lo = max(focus_step - before, 0)
    hi = focus_step + after + 1
    for r, s in marks[1:]:
        # widen (a little) so that every marked cell shows when they are close
        if abs(s - focus_step) <= 3 * (before + after):
            lo = min(lo, max(s - 1, 0))
            hi = max(hi, s + 2)
    ranks_to_show = list(range(len(grid)))
    if len(ranks_to_show) > max_ranks:  # many ranks: the marked ones and the focus's neighbours
        near = {r for r in ranks_to_show if abs(r - focus_rank) <= 2}
        ranks_to_show = sorted(near | {r for r, _ in marks})
    def cell(r: int, s: int) -> str:
        row = grid[r]
        if s >= len(row):
            return ""
        text = printable(str(row[s]))  # an imported CSV's cell is the file's text
        return f"[{text}]" if (r, s) in marked else f" {text} "

    # Each step's column is as wide as its widest cell among the ranks shown.
    widths = {s: max(max((len(cell(r, s)) for r in ranks_to_show), default=0), len(f"s{s}")) + 1 for s in range(lo, hi)}
    label_width = len(f"rank {len(grid) - 1}")
    lead = "    " if lo > 0 else ""
    lines = [" " * label_width + " | " + lead + "".join(f"{'s' + str(s):<{widths[s]}}" for s in range(lo, hi)).rstrip()]
    previous = None
    for r in ranks_to_show:
        if previous is not None and r != previous + 1:
            lines.append(" " * label_width + " | ...")
        previous = r
        cells = "".join(f"{cell(r, s):<{widths[s]}}" for s in range(lo, hi))
        tail = " ..." if hi < len(grid[r]) else ""
        head = "... " if lo > 0 else ""
        lines.append(f"{'rank ' + str(r):>{label_width}} | {head}{cells.rstrip()}{tail}")
    return "\n".join(lines)


# --------------------------------------------------------------- runtime faults


class RuntimeFault(PipecError):
    """A worker could not go on: a wait ran past its deadline, or a peer failed.

    Renders on one line as ``rank R, step S (INSTR): MESSAGE``, where S is the
    instruction's index in the rank's list and INSTR its text; a wait's message
    starts ``waited T s for rank Q``. The launcher finds these lines in the
    workers' stderr.

    Attributes:
        rank: the rank that stopped.
        step: the instruction index it stopped at.
        instruction: that instruction's text.
        message: what went wrong.
        peer: the rank waited on, or None.
    """

    def __init__(self, message: str, rank: int, step: int, instruction: str, peer: int | None = None):
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.step = step
        self.instruction = instruction
        self.peer = peer

    def render(self) -> str:
        return printable(f"rank {self.rank}, step {self.step} ({self.instruction}): {self.message}").replace("\n", " ")

    def __str__(self) -> str:
        return self.render()
