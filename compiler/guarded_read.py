"""The one reader of everything pipec takes from a user: files, JSON, integers.

A file, a JSON document or a number a user hands pipec is data, possibly
hostile: whatever it holds, pipec answers within seconds, within memory, with
a located message and never a traceback. Every command reads its inputs
through these functions, so each guard is written once:

* files (``read_bytes``, ``read_text``, ``stream_text_bytes`` for one too
  large to hold, ``map_tokens`` for a token file): only a regular file (a
  folder, ``/dev/zero``, a FIFO or a socket is refused without blocking), at
  most the size limit of its kind (``Kind``), strict UTF-8 (a bad byte is
  located);
* JSON (``read_json``, ``parse_json_text``): nesting, integers (within
  ``+-2^63``) and floats (finite) bounded, each mistake at ``FILE:line:col``;
  ``read_program`` reads a compiled program, recognised by its content
  (``looks_like_program``);
* numbers written as text (a ``-D`` value, a JSON key, a CSV cell):
  ``plain_int`` is the only way one becomes an int, ASCII digits with an
  optional sign (``int()`` also takes ``1_000``, ``٣``, ``³`` and spaces);
  argparse ``type=`` functions ``count_arg``, ``positive_count_arg``,
  ``seconds_arg`` for numeric options;
* the numbers of a cost file (``cost_number_problem``: at most ``COST_LIMIT``
  each, a bandwidth at least ``MIN_BANDWIDTH``), so that no sum a program's
  size can form overflows, and the totals formed from them (``checked_total``:
  a float finite, an integer within ``+-2^63``), the last guard before a total
  is reported or written;
* messages: ``quote`` (a value read from a file, repr-escaped so that no raw
  control character reaches a terminal, shortened) and ``json_type`` (what
  kind of JSON value stood where another was expected).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from pipec.dsl.limits import PLAIN_INT
from pipec.errors import ImportError_, NumberLimitError, PipecError, UsageError

# Integers pipec reads lie in -INT_LIMIT < v < INT_LIMIT (dsl.limits: the
# language's range, so a number read from a file fits everything a schedule
# computes with); 19 digits hold every such value.
INT_LIMIT = 2**63
INT_LIMIT_TEXT = "2^63"
MAX_INT_DIGITS = len(str(INT_LIMIT))  # 19
# Longest value an error message shows before cutting it.
QUOTE_CHARS = 80


@dataclass(frozen=True)
class Kind:
    """A kind of input file and the most bytes pipec reads of it.

    Attributes:
        name: what the file is, in messages ("cost file").
        noun: how "cannot read ..." names it ("the cost file").
        limit: the most bytes read; a larger file is refused before it is read.
        limit_text: the limit as messages show it.
    """

    name: str
    noun: str
    limit: int
    limit_text: str


_MiB = 1 << 20
_GiB = 1 << 30
# A .pipe file is parsed token by token and dsl.limits.MAX_TOKENS (25,000)
# bounds a file's tokens: 1 MiB is 40 characters per token, comments included
# (the largest shipped schedule is under 10 KB).
SOURCE = Kind(".pipe source", "the .pipe source", 1 * _MiB, "1 MiB")
# A cost file is a few sections; its one table that grows is per pair of
# ranks ("links.pairs", ~35 bytes a pair): 16 MiB holds every pair of 960 ranks.
COSTS = Kind("cost file", "the cost file", 16 * _MiB, "16 MiB")
# A partition file (pipec partition -o) has a name per layer (at most costs.MAX_LAYERS of 200 characters)
# and a small object per stage (at most one per layer): 4 MiB holds the largest.
PARTITION = Kind("partition file", "the partition file", 4 * _MiB, "4 MiB")
# A compiled program (pipec compile --format json) of P=64, N=512 is about
# 72 MB; 256 MiB leaves room for 3.5 times that, and bounds the parse (Python
# holds a JSON document in about 10x its size).
PROGRAM = Kind("program JSON", "the program", 256 * _MiB, "256 MiB")
# A run's trace (pipec run --trace) has one event (~200 bytes) per instruction
# per step: 10 steps of P=64, N=512 (~200,000 instructions a step) are ~400 MB.
TRACE = Kind("trace", "trace", 1024 * _MiB, "1 GiB")
# A torch schedule CSV has one cell (3-12 bytes) per action: 64 MiB is over
# 5 million actions, more than the 2,000,000 tasks pipec compiles (dsl.limits.MAX_TASKS).
TORCH_CSV = Kind("torch schedule CSV", "the torch schedule CSV", 64 * _MiB, "64 MiB")
# A token file is memory-mapped, never read whole: the limit bounds the address
# space one mapping takes (64 GiB: 32 G tokens of uint16), not memory.
TOKENS = Kind("token file", "the token file", 64 * _GiB, "64 GiB")
# A text file made into byte-level tokens is streamed; its tokens (uint16) take
# twice its size, and 16 GiB of text keeps them within the token file's limit.
TEXT = Kind("text file", "the text file", 16 * _GiB, "16 GiB")
# How a token file's ids are stored (little-endian, as numpy writes them on
# every machine pipec runs on): dtype name -> numpy dtype.
TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4", "int32": "<i4"}
# Bytes per chunk of a streamed file.
STREAM_CHUNK = 1 * _MiB

# A training checkpoint (pipec run --save F: F.resume) holds the whole model and its optimizer state;
# it is memory-mapped, not read whole, so the limit only refuses what is surely no checkpoint.
CHECKPOINT = Kind("pipec checkpoint", "the checkpoint", 1024 * _GiB, "1 TiB")

_PLAIN_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
# A decimal with a sign and an exponent: what ``plain_float`` reads.
_PLAIN_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# The longest decimal ``plain_float`` reads.
MAX_DECIMAL_CHARS = 40


class _Refused(Exception):
    """Internal: a JSON number hook's refusal; located by ``parse_json_text``."""

    def __init__(self, problem: str, token: str):
        super().__init__(problem)
        self.problem, self.token = problem, token


# ----------------------------------------------------------------- quoting


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages: ``an integer``, ``an array``, ``the string 'x'`` (quoted)."""
    names = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))
    for python_type, name in names:
        if isinstance(value, python_type):
            if python_type is str:
                return f"the string {quote(value)}"
            return name
    return "null"


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``value`` as an error message may show it: ``repr`` (non-printable
    characters escaped), cut to about ``limit`` characters with the length said.

    A string keeps both ends (``'/tmp/a/b...c/d/file.csv' (95 characters)``): where it is a path, its
    end names the file, the part a reader needs."""
    text = repr(value) if isinstance(value, str) else _short_repr(value, limit)
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        keep = max(1, (limit - 3) // 2)
        return f"{text[:keep]}...{text[-keep:]} ({len(value)} characters)"
    return f"{text[:limit - 3]}...({len(text)} characters shown)"


def read_int_list(values: list, what: str, bound: int | None) -> list[int]:
    """``values`` of a program file's field ``what``, each an integer in 0..bound-1 (>= 0 when ``bound`` is None).

    Raises:
        ImportError_: naming the first entry that is not.
    """
    for i, v in enumerate(values):
        if type(v) is not int or v < 0 or (bound is not None and v >= bound):
            limit = f" in 0..{bound - 1}" if bound is not None else " >= 0"
            raise ImportError_(f"\"{what}\"[{i}] must be an integer{limit}, got {quote(v)}")
    return list(values)


def _short_repr(value: Any, limit: int) -> str:
    """repr of a JSON value, bounded: a huge list is not printed whole first."""
    if isinstance(value, (list, dict)) and len(value) > limit:
        return f"<a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} items>"
    try:
        return repr(value)
    except RecursionError:
        return "<a deeply nested JSON value>"


# ----------------------------------------------------------------- files


def _open_regular(path: str, kind: Kind, error: type[PipecError]) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading without blocking and check it is a regular file within ``kind``'s limit.

    Returns:
        (the open descriptor, its ``fstat``); the caller closes it.
    Raises:
        error: no such file, not a regular file (a folder, a device, a FIFO:
            refused without waiting), unreadable, or over the limit.
    """
    shown = shown_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"cannot read {kind.noun} '{shown}': no such file") from None
    except (OSError, ValueError) as failure:  # ValueError: a NUL in the path
        raise error(f"cannot read {kind.noun} '{shown}': {_reason(failure)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, a FIFO or a socket)"
            raise error(f"{shown}: {what}; expected a {kind.name}")
        if info.st_size > kind.limit:
            raise error(f"{shown}: {_size(info.st_size)}, over the {kind.limit_text} limit for a {kind.name}")
    except OSError as failure:
        os.close(fd)
        raise error(f"cannot read {kind.noun} '{shown}': {_reason(failure)}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_bytes(path: str, kind: Kind, error: type[PipecError] = UsageError) -> bytes:
    """The bytes of the regular file ``path``, at most ``kind.limit`` of them.

    Args:
        path: the file, as the user gave it.
        kind: what it is (its name and size limit).
        error: the ``PipecError`` subclass to raise.
    Raises:
        error: no such file, not a regular file (a folder, a device, a FIFO:
            refused without waiting), unreadable, or over the limit.
    """
    shown = shown_path(path)
    fd, _ = _open_regular(path, kind, error)
    try:
        with os.fdopen(fd, "rb", closefd=True) as handle:
            fd = -1
            data = handle.read(kind.limit + 1)  # a file growing while read is still bounded
    except OSError as failure:
        raise error(f"cannot read {kind.noun} '{shown}': {_reason(failure)}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > kind.limit:
        raise error(f"{shown}: over the {kind.limit_text} limit for a {kind.name}")
    return data


def regular_file_size(path: str, kind: Kind, error: type[PipecError] = UsageError) -> int:
    """The size of the regular file ``path``, after ``read_bytes``'s checks, without reading it (for a file
    that ``torch.load`` memory-maps: a checkpoint).

    Raises:
        error: as ``read_bytes``.
    """
    fd, info = _open_regular(path, kind, error)
    os.close(fd)
    return info.st_size


def shown_path(path: str) -> str:
    """A path as messages show it: as given when printable, else escaped (it may come from a file: a trace)."""
    if path.isprintable() and len(path) <= 400:
        return path
    text = repr(path)[1:-1]  # escaped, without the quotes a message puts around it
    return text if len(text) <= 400 else f"{text[:190]}...({len(path)} characters)...{text[-190:]}"


def read_text(path: str, kind: Kind, error: type[PipecError] = UsageError) -> str:
    """The UTF-8 text of the regular file ``path`` (``read_bytes``'s guards).

    Raises:
        error: ``read_bytes``'s, or a byte that is not UTF-8 (``FILE:line:col``).
    """
    data = read_bytes(path, kind, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = data.count(b"\n", 0, bad.start) + 1
        col = bad.start - (data.rfind(b"\n", 0, bad.start) + 1) + 1
        raise error(f"{shown_path(path)}:{line}:{col}: the {kind.name} is not UTF-8 text "
                    f"(byte 0x{data[bad.start]:02x})") from None


def _reason(failure: Exception) -> str:
    return getattr(failure, "strerror", None) or str(failure)


def _size(nbytes: int) -> str:
    return f"{nbytes / _MiB:.1f} MiB" if nbytes >= _MiB else f"{nbytes} bytes"


def stream_text_bytes(path: str, kind: Kind, error: type[PipecError] = UsageError,
                      chunk_size: int = STREAM_CHUNK) -> Iterator[bytes]:
    """The bytes of the regular file ``path`` in chunks, checked to be UTF-8 as they stream.

    ``read_text``'s guards for a file too large to hold: the same refusals
    before the first byte is read, the size limit held while reading (a file
    that grows is cut off), and the first byte that is not UTF-8 located at
    ``FILE:line:col`` whichever chunk it falls in (a character split across
    two chunks is whole UTF-8).

    Args:
        path: the file.
        kind: what it is (its name and size limit).
        error: the ``PipecError`` subclass to raise.
        chunk_size: bytes per chunk (the last may be shorter).
    Yields:
        the file's bytes, in order, in chunks of at most ``chunk_size``; nothing for an empty file.
    Raises:
        error: ``read_bytes``'s, or a byte that is not UTF-8 (``FILE:line:col``),
            or a sequence cut short at the end of the file.
    """
    import codecs

    shown = shown_path(path)
    fd, _ = _open_regular(path, kind, error)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = line_start = 0  # bytes yielded; newlines in them; offset after the last newline
    try:
        with os.fdopen(fd, "rb", closefd=True) as handle:
            fd = -1
            while True:
                try:
                    chunk = handle.read(chunk_size)
                except OSError as failure:
                    raise error(f"cannot read {kind.noun} '{shown}': {_reason(failure)}") from None
                if offset + len(chunk) > kind.limit:
                    raise error(f"{shown}: over the {kind.limit_text} limit for a {kind.name}")
                pending = decoder.getstate()[0]  # the start of a character the last chunk cut
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as bad:
                    window = pending + chunk  # bad.start counts from the pending bytes (never a newline)
                    before = window[:bad.start]
                    newlines = before.count(b"\n")
                    start = offset - len(pending) + before.rfind(b"\n") + 1 if newlines else line_start
                    column = offset - len(pending) + bad.start - start + 1
                    raise error(f"{shown}:{lines + newlines + 1}:{column}: the {kind.name} is not UTF-8 text "
                                f"(byte 0x{window[bad.start]:02x})") from None
                if not chunk:
                    return
                newlines = chunk.count(b"\n")
                if newlines:
                    lines += newlines
                    line_start = offset + chunk.rfind(b"\n") + 1
                offset += len(chunk)
                yield chunk
    finally:
        if fd >= 0:
            os.close(fd)


def map_tokens(path: str, dtype: str, min_tokens: int, error: type[PipecError] = UsageError, *,
               needed_for: str = "") -> Any:
    """The token ids of the token file ``path``, memory-mapped read-only (nothing is read until used).

    A token file is a flat array of token ids, little-endian, nothing else
    (``python -m pipec.examples.make_tokens`` writes one).

    Args:
        path: the file.
        dtype: how an id is stored: a key of ``TOKEN_DTYPES`` (uint16, uint32, int32).
        min_tokens: the fewest ids the caller can use (at least 1).
        error: the ``PipecError`` subclass to raise.
        needed_for: what ``min_tokens`` is, for the message (``"one window: seq_len + 1"``).
    Returns:
        a read-only 1-D ``numpy.ndarray`` of the ids, backed by the file (the
        mapping lives as long as the array; the file's descriptor is closed).
    Raises:
        error: ``read_bytes``'s refusals (with the ``TOKENS`` limit), a dtype
            that is not one of ``TOKEN_DTYPES``, a size that is not a whole
            number of ids, or fewer than ``min_tokens`` ids.
    """
    import mmap

    import numpy

    shown = shown_path(path)
    if dtype not in TOKEN_DTYPES:
        raise error(f"token dtype {quote(dtype)} is not one of {', '.join(TOKEN_DTYPES)}")
    itemsize = numpy.dtype(TOKEN_DTYPES[dtype]).itemsize
    fd, info = _open_regular(path, TOKENS, error)
    try:
        size = info.st_size
        if size % itemsize:
            raise error(f"{shown}: {size:,} bytes is not a whole number of {dtype} token ids ({itemsize} bytes "
                        f"each): a file of ids of another dtype, or one cut short")
        count = size // itemsize
        if count < max(1, min_tokens):
            need = f" ({needed_for})" if needed_for else ""
            raise error(f"{shown}: {count:,} token ids, fewer than the {max(1, min_tokens):,} needed{need}")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as failure:
        raise error(f"cannot read {TOKENS.noun} '{shown}': {_reason(failure)}") from None
    finally:
        os.close(fd)
    return numpy.frombuffer(mapping, dtype=TOKEN_DTYPES[dtype])


# ----------------------------------------------------------------- JSON


def read_json(path: str, kind: Kind, error: type[PipecError] = UsageError) -> Any:
    """The JSON document in the regular file ``path``, guarded (see ``parse_json_text``).

    Raises:
        error: ``read_text``'s or ``parse_json_text``'s.
    """
    return parse_json_text(read_text(path, kind, error), shown_path(path), error, what=kind.name)


def parse_json_text(text: str, name: str, error: type[PipecError] = UsageError, what: str = "file") -> Any:
    """Parse JSON whose every number is one pipec can use.

    A hook checks each number as it is parsed: an integer's digits are counted
    before ``int()`` sees them, a float is refused when it overflows to infinity.

    Args:
        text: the document.
        name: the file it came from, for messages.
        what: what the file is, for messages ("trace").
        error: the ``PipecError`` subclass to raise.
    Returns:
        the value; its ints lie in ``-2^63 < v < 2^63``, its floats are finite.
    Raises:
        error: at ``name:line:col`` (or ``name: KEY:`` for a number whose key
            is known, the line and column after): not JSON; nested deeper than Python's
            parser goes (about 1000 levels; pipec's formats use under 10);
            ``NaN`` / ``Infinity``; an integer of more than ``MAX_INT_DIGITS``
            digits or outside the range; a float that overflows to infinity.
    """
    try:
        # a hook per number adds 10-40% to json.loads (measured on a 4 MB program and a
        # 28 MB trace); a regex pre-scan to skip the hooks when no number is long cost more
        return json.loads(text, parse_constant=_refuse_constant, parse_int=_checked_int, parse_float=_checked_float)
    except json.JSONDecodeError as bad:
        raise error(f"{name}:{bad.lineno}:{bad.colno}: not valid JSON: {bad.msg} (the {what} is not JSON, "
                    "or is cut short)") from None
    except RecursionError:
        at = _deepest(text)
        where = "%s:%d:%d" % ((name,) + _position(text, at)) if at >= 0 else name
        raise error(f"{where}: JSON nested deeper than Python's parser allows "
                    f"(about {_PARSER_DEPTH} levels; a pipec file nests under 10)") from None
    except _Refused as refused:
        at = _find_number(text, refused.token)
        if at < 0:
            raise error(f"{name}: {refused.problem}") from None
        line, col = _position(text, at)
        key = _key_path(text, at)
        if key:  # the form every other mistake of a JSON file takes: FILE: KEY: problem
            raise error(f"{name}: {key}: {refused.problem} (line {line}, column {col})") from None
        raise error(f"{name}:{line}:{col}: {refused.problem}") from None


_PARSER_DEPTH = 1000


def _refuse_constant(token: str):
    raise _Refused(f"{token} is not a number pipec accepts (JSON has no NaN or Infinity)", token)


def _checked_int(token: str) -> int:
    if len(token) < MAX_INT_DIGITS:  # at most 18 digits: below 2^63 (the common case, kept short)
        return int(token)
    digits = len(token.lstrip("-"))
    if digits > MAX_INT_DIGITS or not -INT_LIMIT < int(token) < INT_LIMIT:
        shown = token if len(token) <= 30 else f"{token[:20]}...({digits} digits)"
        raise _Refused(f"the integer {shown} is outside pipec's range (-{INT_LIMIT_TEXT} < n < {INT_LIMIT_TEXT})", token)
    return int(token)


def _checked_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        shown = token if len(token) <= 30 else f"{token[:20]}...({len(token)} characters)"
        raise _Refused(f"the number {shown} overflows to infinity", token)
    return value


def _find_number(text: str, token: str) -> int:
    """The offset of the number ``token`` standing alone (not inside a longer number or a word); -1 if none."""
    match = re.search(r"(?<![0-9A-Za-z.+-])" + re.escape(token) + r"(?![0-9A-Za-z.])", text)
    return match.start() if match else text.find(token)


# JSON's structural tokens and strings, for naming the key of a refused number.
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')
# Past this offset a refused number is located by line and column only (naming
# its key rescans the text before it).
_KEY_SCAN_LIMIT = 4 * _MiB


def _key_path(text: str, offset: int) -> str:
    """The key path (``compute.F``, ``traceEvents[3].ts``) of the value at ``offset``; "" when not found."""
    if offset > _KEY_SCAN_LIMIT:
        return ""
    stack: list[list] = []  # ["{", key or None] or ["[", index]
    for match in _STRUCTURE.finditer(text, 0, offset):
        token = match.group()
        if token in "{[":
            stack.append([token, None if token == "{" else 0])
        elif token in "]}":
            if stack:
                stack.pop()
        elif token == ",":
            if stack:
                stack[-1][1] = stack[-1][1] + 1 if stack[-1][0] == "[" else None
        elif token != ":" and stack and stack[-1][0] == "{" and stack[-1][1] is None:
            try:
                stack[-1][1] = json.loads(token)
            except ValueError:
                stack[-1][1] = token[1:-1]
    path = ""
    for kind, key in stack:
        if kind == "[":
            path += f"[{key}]"
        elif key is not None:
            shown = key if key.isprintable() and len(key) <= 40 else quote(key, 40)
            path += f".{shown}" if path else shown
    return path


def _position(text: str, offset: int) -> tuple[int, int]:
    """(line, column) of a character offset, both from 1."""
    offset = max(0, min(offset, len(text)))
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _deepest(text: str) -> int:
    """The offset where nesting first passes ``_PARSER_DEPTH`` (strings skipped), searched in the
    first ``_KEY_SCAN_LIMIT`` characters only (a scan per token); -1 when not found there. Error path only."""
    depth = 0
    for match in _STRUCTURE.finditer(text, 0, _KEY_SCAN_LIMIT):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth >= _PARSER_DEPTH:
                return match.start()
        elif token in "]}":
            depth -= 1
    return -1


# ----------------------------------------------------------------- integers


def is_plain_int(text: str) -> bool:
    """True when ``text`` (spaces stripped) is written like an integer ``plain_int`` reads:
    ``[+-]?[0-9]+``, any length (a caller that states its own range checks that)."""
    return PLAIN_INT.fullmatch(text.strip()) is not None


def plain_int(text: str, what: str, error: type[PipecError] = UsageError, *, low: int | None = None,
              high: int | None = None) -> int:
    """``text`` as an int, when it is a plain ASCII decimal integer.

    Accepts ``[+-]?[0-9]+`` of at most ``MAX_INT_DIGITS`` digits (surrounding
    spaces stripped), nothing else: not ``1_000``, ``٣``, ``³``, ``0x10``, ``1e3``.

    Args:
        text: the text.
        what: what it is, for messages (``"-D P"``, ``"compute.per_chunk key"``).
        error: the ``PipecError`` subclass to raise.
        low, high: inclusive bounds, when given.
    Raises:
        error: naming ``what`` and quoting ``text``.
    """
    stripped = text.strip()
    if not PLAIN_INT.fullmatch(stripped):
        raise error(f"{what}: expected an integer written in ASCII digits, got {quote(text)}")
    if len(stripped.lstrip("+-")) > MAX_INT_DIGITS or not -INT_LIMIT < int(stripped) < INT_LIMIT:
        raise error(f"{what}: {quote(text, 40)} is outside pipec's integer range (-{INT_LIMIT_TEXT} < n < {INT_LIMIT_TEXT})")
    value = int(stripped)
    if low is not None and value < low:
        raise error(f"{what}: expected at least {low}, got {value}")
    if high is not None and value > high:
        raise error(f"{what}: expected at most {high}, got {value}")
    return value


# ----------------------------------------------------------------- cost numbers and totals

# The largest number a cost file gives (a time per task, message, latency or post, in the file's unit:
# ms as pipec measures them, so 1e15 is 31,700 years; bytes of a value, a message, a layer: a petabyte;
# a bandwidth), and the API's cost models are held to the same (``costs.CostModel``). A program has at
# most a few 10^7 instructions (a 256 MiB program file; the language stops at 2,000,000 tasks), so every
# float sum the simulator, the partitioner and the memory check form stays below 1e38, far from float's
# 1.8e308; integer sums are exact, and ``checked_total`` holds them to pipec's range.
COST_LIMIT = 10**15
COST_LIMIT_TEXT = "1e15"
# The smallest bandwidth (bytes per time unit): a message's bytes / bandwidth stays at most 1e30.
MIN_BANDWIDTH = 1e-15
MIN_BANDWIDTH_TEXT = "1e-15"
# Where the limits are stated for users.
LIMITS_DOC = 'docs/costs.md, "Limits"'


def cost_number_problem(value: Any, *, bandwidth: bool = False) -> str | None:
    """What is wrong with ``value`` as a number of a cost model beyond its type and sign, or None when nothing is.

    Args:
        value: an int or a float (a reader has checked the type).
        bandwidth: ``value`` is a bandwidth: also at least ``MIN_BANDWIDTH``.
    Returns:
        ``"1e+308 is above pipec's limit of 1e15 ..."`` for a number not finite, above ``COST_LIMIT``
        (or below ``-COST_LIMIT``), or a bandwidth below ``MIN_BANDWIDTH``; None otherwise.
    """
    shown = f"{value:g}" if isinstance(value, float) else quote(value, 40)
    if value != value or abs(value) > COST_LIMIT:  # nan, +-inf and every number past the limit
        return (f"{shown} is above pipec's limit of {COST_LIMIT_TEXT} for a number of a cost file (a time, "
                f"bytes or a bandwidth), which keeps every sum of a program's costs finite ({LIMITS_DOC})")
    if bandwidth and value < MIN_BANDWIDTH:
        return (f"a bandwidth of {shown} is below pipec's limit of {MIN_BANDWIDTH_TEXT}, which keeps every "
                f"transfer's time finite ({LIMITS_DOC})")
    return None


def checked_total(value: Any, what: str, source: str = "") -> Any:
    """``value``, a total pipec formed from the numbers it read, when pipec can report it.

    Args:
        value: an int, a float or a ``Fraction``.
        what: what it is, for the message (``"rank 2's busy time"``).
        source: the file its numbers came from (a cost file), "" when not known.
    Returns:
        ``value``.
    Raises:
        NumberLimitError: a float that is not finite (a sum that overflowed), or an int (or exact
            fraction) outside ``-2^63 < v < 2^63``, naming ``source`` and ``what``.
    """
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        problem = f"overflows ({value})"
    elif -INT_LIMIT < value < INT_LIMIT:
        return value
    else:
        digits = str(abs(int(value)))
        shown = f"{int(value):,}" if len(digits) <= 30 else f"an integer of {len(digits)} digits"
        problem = f"is {shown}, past pipec's integer range (-{INT_LIMIT_TEXT} < n < {INT_LIMIT_TEXT})"
    where = f"{source}: " if source else ""
    raise NumberLimitError(f"{where}{what} {problem}: the costs are too large for this program (each number of a "
                           f"cost file is at most {COST_LIMIT_TEXT}, and a total must stay finite and an integer "
                           f"total below {INT_LIMIT_TEXT}; {LIMITS_DOC})")


def plain_float(text: str, what: str, error: type[PipecError] = UsageError, *, high: float | None = None,
                high_text: str = "") -> float:
    """``text`` as a finite float, when it is a plain ASCII decimal: ``[+-]?`` digits with an optional
    point and exponent (``3e-4``, ``-0.5``), at most ``MAX_DECIMAL_CHARS`` characters (spaces stripped);
    not ``inf``, ``nan``, ``1_0.5``, ``٣``, ``0x1p3``.

    Args:
        text: the text.
        what: what it is, for messages (``"--config lr"``).
        error: the ``PipecError`` subclass to raise.
        high: the largest value accepted, when given (``high_text`` as messages show it).
    Raises:
        error: naming ``what`` and quoting ``text``.
    """
    stripped = text.strip()
    if not _PLAIN_FLOAT.fullmatch(stripped):
        raise error(f"{what}: expected a decimal number in ASCII digits (e.g. 0.5 or 3e-4), got {quote(text, 40)}")
    if len(stripped) > MAX_DECIMAL_CHARS:
        raise error(f"{what}: a decimal of {len(stripped)} characters; write at most {MAX_DECIMAL_CHARS}")
    value = float(stripped)
    if not math.isfinite(value):
        raise error(f"{what}: {quote(text, 40)} overflows to infinity")
    if high is not None and value > high:
        raise error(f"{what}: {quote(text, 40)} is above pipec's limit of {high_text or high}")
    return value


# ----------------------------------------------------------------- argparse types


class _ArgError(UsageError):
    pass


def _int_arg(low: int, kind: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return plain_int(text, "value", _ArgError, low=low)
        except _ArgError:
            raise argparse.ArgumentTypeError(f"expected {kind} (ASCII digits), got {quote(text, 40)}") from None

    parse.__name__ = kind  # argparse names the type in some messages
    return parse


# --budget, --steps, --seed: an integer >= 0.
count_arg = _int_arg(0, "an integer >= 0")
# --nproc, --step: an integer >= 1.
positive_count_arg = _int_arg(1, "an integer >= 1")

# The longest --timeout: about 11.6 days (a longer wait is a hang, and
# datetime.timedelta, which torch's group timeout is, stays far from overflow).
MAX_SECONDS = 1_000_000


# The largest value of a plain positive decimal option (--clip-grad-norm): far past any use, far from overflow.
MAX_DECIMAL = 1e12


def _decimal_arg(high: float, kind: str, expected: str) -> Callable[[str], float]:
    """An argparse type of a plain decimal, 0 < value <= ``high`` (not inf, nan or an exponent)."""
    def parse(text: str) -> float:
        stripped = text.strip()
        value = float(stripped) if _PLAIN_DECIMAL.fullmatch(stripped) and len(stripped) <= 40 else None
        if value is None or not 0 < value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {quote(text, 40)}")
        return value

    parse.__name__ = kind  # argparse names the type in some messages
    return parse


# --timeout, --join-timeout: a duration in seconds.
seconds_arg = _decimal_arg(MAX_SECONDS, "seconds", f"seconds, a decimal number above 0 and at most {MAX_SECONDS:,}")
# --clip-grad-norm: a positive number.
positive_decimal_arg = _decimal_arg(MAX_DECIMAL, "number", f"a decimal number above 0 and at most {MAX_DECIMAL:g}")


# ----------------------------------------------------------------- programs


def looks_like_program(path: str) -> bool:
    """True when ``path`` is a regular file whose first non-blank character is
    ``{`` or ``[``: a JSON document (a compiled program), never a ``.pipe`` source."""
    head = _head(path)
    return head is not None and head[:1] in (b"{", b"[")


def _head(path: str) -> bytes | None:
    """The first 4 KiB of the regular file ``path`` from its first non-blank byte (b"" when it has none), or
    None when ``path`` is no regular file one can read. Opened without blocking: a FIFO is never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return head.lstrip(b" \t\r\n\xef\xbb\xbf")


# The shape of a torch.distributed.pipelining action, a CSV's first cell: a stage, a type, a microbatch
# (``0F0``, ``1SEND_B3``) or a group of them (``(0F0;1B1)OVERLAP_F_B``), up to the cell's end.
_ACTION_CELL = re.compile(rb"(?:[0-9]+[A-Z][A-Z_]*[0-9]*|\([^()\r\n,]*\)[A-Z][A-Z_]*)[ \t]*(?:,|\r|\n|$)")


def looks_like_torch_csv(path: str) -> bool:
    """True when ``path`` is a regular file named ``*.csv``, or whose first cell is a torch action
    (``0F0``, ``(0F0;1B1)OVERLAP_F_B``): a torch.distributed.pipelining schedule CSV, never a ``.pipe``
    source (which starts with a word or a comment) nor a text that happens to start with a digit."""
    head = _head(path)
    return head is not None and (path.lower().endswith(".csv") or _ACTION_CELL.match(head) is not None)


def read_program(path: str, error: type[PipecError] = UsageError):
    """The compiled program (``pipec compile --format json``) in ``path``, unchecked.

    Raises:
        error: ``read_json``'s (with the ``PROGRAM`` limit), or a JSON document
            that is not a pipec program (its ``"format"`` quoted).
        ImportError_: a pipec program whose content is invalid (``program_from_json``).
    """
    from pipec.compiler.emit.json_program import FORMAT, program_from_json

    data = read_json(path, PROGRAM, error)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = quote(data.get("format")) if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise error(f"{path}: not a pipec program (a JSON object with \"format\": \"{FORMAT}\", as "
                    f"`pipec compile --format json` writes; found {found})")
    return program_from_json(data)


__all__ = [
    "CHECKPOINT", "COST_LIMIT", "COSTS", "MIN_BANDWIDTH", "checked_total", "cost_number_problem", "Kind", "is_plain_int", "MAX_INT_DIGITS", "PARTITION", "PROGRAM", "SOURCE", "TEXT", "TOKENS",
    "TOKEN_DTYPES", "TORCH_CSV", "TRACE", "count_arg", "json_type", "looks_like_program", "map_tokens", "parse_json_text",
    "plain_float", "plain_int", "positive_count_arg", "positive_decimal_arg", "quote", "read_bytes", "read_json", "read_program",
    "read_text", "regular_file_size", "seconds_arg", "shown_path", "stream_text_bytes",
]
