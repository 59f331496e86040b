"""Make a token file from any text file: ``python -m pipec.examples.make_tokens INPUT.txt -o tokens.bin``.

Byte-level tokens: token t is byte t of the file's UTF-8 text, an id in
0 .. 255, stored as uint16 (little-endian), nothing else in the file: what
``pipec.examples.token_file`` trains on (its default vocabulary is 256). The
input is streamed through the guarded reader (a regular file, at most
``guarded_read.TEXT``'s limit, strict UTF-8 with the first bad byte located)
and the tokens through the atomic writer, so a failure leaves no half-made
token file. It prints the token count and the command that trains on them.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import numpy

from pipec.compiler.atomic_write import atomic_writer
from pipec.compiler.guarded_read import TEXT, TOKEN_DTYPES, shown_path, stream_text_bytes
from pipec.errors import PipecError, UsageError

PROG = "python -m pipec.examples.make_tokens"
# How the ids are stored: uint16 holds every byte, and is token_file's default dtype.
DTYPE = "uint16"


def make_tokens(source: str, output: str) -> int:
    """Write the byte-level tokens of the text file ``source`` to the token file ``output``.

    Args:
        source: a UTF-8 text file.
        output: the token file to (re)place.
    Returns:
        the number of tokens written (the input's size in bytes).
    Raises:
        UsageError: the guarded reader's refusals of ``source`` (missing,
            not a regular file, unreadable, over the limit, not UTF-8), an
            empty ``source`` or one holding a NUL byte (a binary file), or
            ``output`` that cannot be written; ``output`` is then left as it was.
    """
    count = 0
    with atomic_writer(output, binary=True, what="the token file") as out:
        for chunk in stream_text_bytes(source, TEXT):
            nul = chunk.find(b"\0")
            if nul >= 0:  # valid UTF-8, but no text holds it: a binary file (a token file, say)
                raise UsageError(f"{shown_path(source)}: byte {count + nul:,} is NUL: a binary file, not text")
            out.write(numpy.frombuffer(chunk, dtype=numpy.uint8).astype(TOKEN_DTYPES[DTYPE]).tobytes())
            count += len(chunk)
        if count == 0:  # raised inside the writer: no empty token file is left behind
            raise UsageError(f"{shown_path(source)}: the text file is empty: there are no tokens to make")
    return count


def train_command(output: str) -> str:
    """The command that trains the built-in model on the token file ``output``."""
    return ("pipec run 1f1b -D P=4 -D N=8 --model pipec.examples.token_file:SPEC "
            f"--config token_file={shlex.quote(output)}")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error exits 1, as every pipec command's does."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    """Run the script; returns its exit status (1 and one line on stderr for a user's mistake)."""
    parser = _Parser(prog=PROG, description="Make a token file (byte-level ids 0..255, uint16) from a text file.")
    parser.add_argument("input", metavar="INPUT", help="a UTF-8 text file")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the token file to write")
    args = parser.parse_args(argv)
    try:
        count = make_tokens(args.input, args.output)
    except PipecError as error:
        sys.stderr.write(error.render() + "\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; {shown_path(args.output)} left as it was\n")
        return 130
    print(f"{shown_path(args.output)}: {count:,} tokens (byte-level, ids 0..255, {DTYPE}) from "
          f"{shown_path(args.input)}")
    print(f"train on them: {train_command(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
