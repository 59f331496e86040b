"""Tensor parallelism's meaning in the one symbolic run: every slice computed once, on whole inputs.

The engine of ``checks/symbolic.py`` meets the all-reduces (the k-th on every
rank must be the same layer and microbatch, ``signature``), waits them and
names a deadlock. ``TensorSemantics`` adds what the family's ops mean, per
rank: a forward TF(l, m) runs once, on the whole output of layer l - 1 (its
all-reduce waited on this rank) or the microbatch's input; a backward
TB(l, m) runs once, after TF(l, m) on this rank, on the whole gradient of
layer l's output (the all-reduced input gradient of layer l + 1, or the
loss's, which needs the last layer's whole output); an all-reduce sums a
partial this rank made and has not posted before; at the end every partial
but layer 0's input gradient was all-reduced. Errors name the rank, the
instruction and the layer and microbatch (``CoverageError``, ``RouteError``).
"""
from __future__ import annotations

from pipec.compiler import ops
from pipec.compiler.checks.symbolic import Part, RankState, Semantics, register_semantics
from pipec.compiler.ir import Action
from pipec.errors import CoverageError, RouteError, WellFormedError

_PASS = {ops.TF: "forward", ops.TB: "backward", ops.ALLREDUCE_TF: "forward", ops.ALLREDUCE_TB: "backward"}


def _task(op: str, layer: int, mb: int) -> str:
    return f"{_PASS[op]} of layer {layer}, microbatch {mb}"


@register_semantics
class TensorSemantics(Semantics):
    """The tensor-parallel family's ops for the one prover: per rank, the partial sums it made, posted and
    received whole (module docstring)."""

    family = ops.TENSOR_PARALLEL
    part_ops = frozenset((ops.ALLREDUCE_TF, ops.ALLREDUCE_TB))

    def __init__(self, run):
        super().__init__(run)
        self.layers, self.N = len(self.program.stages), self.program.num_microbatches
        self.done = [set() for _ in range(self.P)]       # (op, layer, mb) computed on the rank
        self.posted = [set() for _ in range(self.P)]     # (task op, layer, mb) whose partial is being summed
        self.whole = [set() for _ in range(self.P)]      # (task op, layer, mb) whose sum arrived on the rank

    def signature(self, part: Part) -> tuple:
        return (part.action.op, part.action.stage, part.action.mb)

    def step(self, state: RankState, action: Action) -> None:
        if action.op not in (ops.TF, ops.TB):
            return
        rank, layer, mb = state.rank, action.stage, action.mb
        if not (0 <= layer < self.layers and 0 <= mb < self.N):
            raise self.error(WellFormedError, f"{action.text()} names no task of {self.layers} layers and "
                             f"{self.N} microbatches", rank, state.pc)
        key = (action.op, layer, mb)
        what = _task(action.op, layer, mb)
        if key in self.done[rank]:
            raise self.error(CoverageError, f"{action.text()}: the {what} runs twice on rank {rank}", rank, state.pc)
        if action.op == ops.TB and (ops.TF, layer, mb) not in self.done[rank]:
            raise self.error(CoverageError, f"{action.text()}: the {what} runs before its forward on this rank",
                             rank, state.pc)
        needs = self._needs(action.op, layer, mb)
        if needs is not None and needs not in self.whole[rank]:
            raise self.error(RouteError, f"{action.text()}: the {what} needs the whole {self._input_text(needs)}, "
                             f"whose all-reduce this rank has not waited", rank, state.pc)
        self.done[rank].add(key)

    def _needs(self, op: str, layer: int, mb: int) -> tuple | None:
        """The whole sum a task reads: the layer before's output, the layer after's input gradient, or (the
        last layer's backward: the loss's gradient) the last layer's output; None: the microbatch's input."""
        if op == ops.TF:
            return (ops.TF, layer - 1, mb) if layer > 0 else None
        return (ops.TB, layer + 1, mb) if layer + 1 < self.layers else (ops.TF, layer, mb)

    @staticmethod
    def _input_text(key: tuple) -> str:
        op, layer, mb = key
        return (f"output of layer {layer}" if op == ops.TF else f"input gradient of layer {layer}") \
            + f" for microbatch {mb}"

    def post(self, state: RankState, part: Part) -> None:
        action, rank = part.action, state.rank
        task = ops.TF if action.op == ops.ALLREDUCE_TF else ops.TB
        key = (task, action.stage, action.mb)
        if key not in self.done[rank]:
            raise self.error(RouteError, f"{action.text()} sums this rank's partial of the "
                             f"{_task(task, action.stage, action.mb)}, which it has not computed", rank, state.pc)
        if key in self.posted[rank]:
            raise self.error(RouteError, f"{action.text()} sums the partial of the "
                             f"{_task(task, action.stage, action.mb)} a second time", rank, state.pc)
        self.posted[rank].add(key)

    def value_text(self, value: tuple) -> str:
        kind, layer, mb = value
        return f"{ops.VALUE_KINDS[kind].words} of layer {layer}, microbatch {mb}"

    def arrive(self, state: RankState, part: Part) -> None:
        action = part.action
        self.whole[state.rank].add((ops.TF if action.op == ops.ALLREDUCE_TF else ops.TB, action.stage, action.mb))

    def finish(self) -> None:
        for rank in range(self.P):
            end = self.run.end_of(rank)
            for mb in range(self.N):
                for layer in range(self.layers):
                    for op in (ops.TF, ops.TB):
                        if (op, layer, mb) not in self.done[rank]:
                            raise self.error(CoverageError, f"the {_task(op, layer, mb)} never runs on rank {rank}",
                                             rank, end)
                        if (op, layer, mb) not in self.posted[rank] and not (op == ops.TB and layer == 0):
                            raise self.error(RouteError, f"rank {rank}'s partial of the {_task(op, layer, mb)} is "
                                             "never all-reduced", rank, end)
