"""Hand-written reference orders, independent of the DSL.

They let the passes (communication, checks, simulator, emitters) be tested
without the front end, and cross-check the shipped ``.pipe`` files. Tests only:
every shipped schedule is a ``.pipe`` file.
"""
from __future__ import annotations

from pipec.compiler.ir import Action, Program, single_pipeline


def compute_program(name: str, stage_ranks: list[int], num_microbatches: int, orders: list[list[tuple[str, int, int]]]) -> Program:
    """A compute-only single-pipeline Program from per-rank (op, stage, mb) lists."""
    stages, pipelines, mb_pipeline = single_pipeline(stage_ranks, num_microbatches)
    ranks = [[Action(s, op, m) for op, s, m in row] for row in orders]
    return Program(name, len(orders), num_microbatches, stages, pipelines, mb_pipeline, ranks)


def one_f_one_b(P: int, N: int) -> Program:
    orders = []
    for r in range(P):
        warm = min(P - 1 - r, N)
        row = [("F", r, m) for m in range(warm)]
        for i in range(N - warm):
            row += [("F", r, warm + i), ("B", r, i)]
        row += [("B", r, m) for m in range(N - warm, N)]
        orders.append(row)
    return compute_program("1f1b", list(range(P)), N, orders)


def gpipe(P: int, N: int) -> Program:
    orders = [[("F", r, m) for m in range(N)] + [("B", r, m) for m in range(N)] for r in range(P)]
    return compute_program("gpipe", list(range(P)), N, orders)


def interleaved_1f1b(P: int, N: int, v: int) -> Program:
    """Megatron's interleaved order; stage c*P + r is chunk c on rank r."""
    assert N % P == 0

    def forward(k: int) -> tuple[int, int]:
        group, within = divmod(k, P * v)
        chunk = within // P
        return chunk, group * P + within % P

    def backward(k: int) -> tuple[int, int]:
        chunk, mb = forward(k)
        return v - 1 - chunk, mb

    total = v * N
    orders = []
    for r in range(P):
        warm = min((P - r - 1) * 2 + (v - 1) * P, total)
        row = []
        for k in range(warm):
            c, m = forward(k)
            row.append(("F", c * P + r, m))
        for i in range(total - warm):
            c, m = forward(warm + i)
            row.append(("F", c * P + r, m))
            c, m = backward(i)
            row.append(("B", c * P + r, m))
        for k in range(total - warm, total):
            c, m = backward(k)
            row.append(("B", c * P + r, m))
        orders.append(row)
    return compute_program("interleaved_1f1b", [s % P for s in range(v * P)], N, orders)
