"""The bounds that keep any ``.pipe`` file, however hostile, quick to reject or compile.

A ``.pipe`` file is data: whatever it says, pipec answers in seconds, within
memory, with a located message. Each limit is checked once, where the thing
it bounds is made (the parser for nesting and literals, the resolver for
function expansion, the evaluator for values and sizes), so nothing later
needs to guard against it.
"""
from __future__ import annotations

import re

# Nesting: every operator, call, conditional, statement and block adds one
# level (a chain ``a + b + c`` nests one level per operator). The resolver and
# the evaluator's closures recurse once or twice per level, so this keeps them
# far below Python's recursion limit (1000).
MAX_NESTING = 200

# Tokens in one file: Lark parses some 30 000 a second (the largest shipped
# schedule has under 900), so any file is parsed, or refused, within a second.
MAX_TOKENS = 25_000

# Operations one expression may expand to once every user function call in it
# is expanded (a function calling another twice, and so on, doubles at each
# level): bounds the resolver's inlining and the work of one evaluation (the
# largest shipped schedule's expression is 50).
MAX_EXPANSION = 1_000

# Integer values: every literal and every result of + - * lies in
# -INT_LIMIT < v < INT_LIMIT; then / % and unary - cannot leave it either.
INT_LIMIT = 2**63
INT_LIMIT_TEXT = "2^63"
MAX_LITERAL_DIGITS = len(str(INT_LIMIT))

# Sizes of the task grid, checked when a schedule is evaluated, before anything
# is built. Measured (compile + check + simulate, peak RSS over an idle
# process): 0.7 to 1.3 KiB per task across 1f1b, interleaved, zb_h1, zbv,
# gpipe and bitpipe, so 2,000,000 tasks stay under about 2.6 GiB.
MAX_TASKS = 2_000_000
BYTES_PER_TASK_TEXT = "about 1.3 KiB each to compile and simulate"
# Weight passing walks every step of every rank (idle or not: a ring steps on
# all of them), so its step grid, ranks x steps, has the task grid's bound.
MAX_STEP_CELLS = MAX_TASKS
# ... but the weight-passing prover (compiler/checks/symbolic.py) grows faster than its cells (issue 24, item 4:
# quadratic in N), so an order's step cells have a lower bound, checked as the order is evaluated, before the
# program is built or proved. Measured on a loaded 2-core machine (pipec simulate --json, CPU seconds):
# weipipe at P=100, N=200 took 14 s and 0.5 GB; at P=200, N=400 past 100 s; at P=350 and P=700 (and tawpipe
# at P=700) it ran out of memory past 5 GB; weipipe at P=120 (about 35,000 cells) took 22 s and fsdp at
# P=200 (60,200 cells) ran past 60 s: 60,000 cells keep a program near a minute.
MAX_PASSING_STEP_CELLS = 60_000
PASSING_LIMIT_TEXT = "the weight-passing proof grows faster than its steps: about a minute of CPU at the limit"
# Sequence rings: the compiler runs a forward and a backward task for each
# visible block (a query chunk against a KV piece): chunks x chunks x pieces
# blocks under a full mask, C (C + 1) / 2 x pieces under a causal one. That
# grid has the task grid's bound; the chunks alone are bounded first, before
# the holder of each is evaluated: 2 x 1,000^2 = MAX_TASKS, the most chunks a
# full mask fits.
MAX_CHUNKS = 1_000
# A sequence ring's attention blocks (a query chunk against a KV piece), which its compile, check and
# simulation cost grows with: measured on a loaded 2-core machine (pipec simulate --json, CPU seconds),
# zigzag_ring at P=250 (125,250 blocks) took 26 s and 1.0 GB, 0.21 ms a block; tasp at P=40 (126,360 blocks
# on 39 rings) 15.8 s and 0.4 GB, 0.13 ms a block. zigzag_ring at P=500 (500,500 blocks) and tasp at P=79
# (979,758) ran past 200 s. 300,000 blocks keep a program to about 60 s, half of the 120 s issue 24 allows.
MAX_RING_BLOCKS = 300_000
RING_LIMIT_TEXT = "about 60 s of CPU to compile and simulate"
# Ranks: a program has per-rank lists and per-pair tables (P^2 entries, about
# 160 MB at P = 4096, compiled in under 2 s).
MAX_RANKS = 4096
# The operations one evaluation of a schedule may run: every expression
# evaluated once per iteration, rank, stage, microbatch or task is charged its
# expanded size times its count, before it runs (a loop: its iterations times
# one plus its body's operations). The shipped schedules take 3 to 40 per
# task; 200,000,000 is some tens of seconds, about as long as compiling the
# largest task grid takes.
MAX_OPERATIONS = 100 * MAX_TASKS


# How pipec reads an integer written as text, wherever it comes from (``-D``, a file, the Python API): ASCII
# digits with an optional sign, nothing else; not ``1_000``, ``٣``, ``³``, ``0x10`` or ``1e3``, some of which
# Python's int() takes.
PLAIN_INT = re.compile(r"[+-]?[0-9]+")


def check_int(value: int) -> bool:
    """True when ``value`` is inside pipec's integer range."""
    return -INT_LIMIT < value < INT_LIMIT
