"""Tensor parallelism (Megatron-LM's MLP): every rank holds a slice of every layer (docs/ir.md, "Adding a family").

The smallest real family, and the worked example of adding one. Its programs
carry a ``TensorPlan``: ``layers`` MLP blocks, each split across all the
ranks; rank r holds columns r/P of the first matrix and rows r/P of the
second, so its forward of a layer (``TF``) makes a partial sum of the
layer's output and its backward (``TB``) a partial sum of the input's
gradient, and an all-reduce of every rank (``ALLREDUCE_TF``,
``ALLREDUCE_TB``, each an exchange part posted by an EXCHANGE and waited
before the task that reads it) makes each whole on every rank. Weight
gradients stay where their slices are: no gradient moves.

Lowering writes every rank's list (the same on every rank): per microbatch,
the layers' forwards in order, then their backwards in reverse, each
followed by its all-reduce; the backward of layer 0 needs none (the input's
gradient is not wanted). The family's ops stand only in its programs; its
tasks are proved by the one symbolic run (``checks/tensor_parallel.py``);
torch's CSV has no form for it; memory budgets do not apply (each rank
keeps every layer's saved activations of one microbatch at a time).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pipec.compiler.family import Family, register
from pipec.compiler.guarded_read import quote
from pipec.compiler.ir import Action, Communicator, Program, StageInfo, build_program
from pipec.compiler.ops import (
    ALLREDUCE_TB, ALLREDUCE_TF, EXCHANGE, EXCHANGE_WAIT, RULES, SHARED, TB,
    TENSOR_PARALLEL, TF, WORLD,
)
from pipec.dsl.limits import MAX_TASKS
from pipec.errors import ImportError_, counted

# What a tensor-parallel program's file may hold: the family's ops and the exchanges that post and wait them.
_PROGRAM_OPS = frozenset(op for op, rule in RULES.items() if rule.family in (TENSOR_PARALLEL, SHARED))
# The all-reduce after each task, by the task.
ALLREDUCE_AFTER = {TF: ALLREDUCE_TF, TB: ALLREDUCE_TB}


@dataclass(frozen=True)
class TensorPlan:
    """How a tensor-parallel program splits its model: ``layers`` MLP blocks, each across all ``num_ranks``.

    Rank r holds columns [r H'/P, (r+1) H'/P) of each layer's first matrix (and that slice of its bias)
    and the same rows of its second, H' being the hidden width: the ranks' partial sums add up to the
    layer's output, and their partial input gradients to the input's gradient.
    """

    layers: int
    num_ranks: int

    def communicators(self, num_ranks: int) -> list[Communicator]:
        """One communicator of every rank: each all-reduce meets on it."""
        return [Communicator(0, tuple(range(num_ranks)), WORLD, 0)]

    def group_of(self, rank: int) -> None:
        """Tensor parallelism groups no ranks apart (its one group is every rank)."""
        return None


def tensor_order(layers: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """Every rank's tasks in order, as (op, layer, microbatch): per microbatch, forwards up the layers,
    then backwards down them (one microbatch's activations held at a time)."""
    order = []
    for mb in range(num_microbatches):
        order += [(TF, layer, mb) for layer in range(layers)]
        order += [(TB, layer, mb) for layer in reversed(range(layers))]
    return order


def tensor_program(plan: TensorPlan, num_microbatches: int, name: str = "", params: dict | None = None,
                   source: str = "") -> Program:
    """The program of ``plan``: each rank's list from ``tensor_order``, every task but layer 0's backward
    followed by an EXCHANGE of its all-reduce and the wait for it (numbered alike on every rank)."""
    row: list[Action] = []
    number = 0  # the exchanges' numbers, counted as they are written
    for op, layer, mb in tensor_order(plan.layers, num_microbatches):
        row.append(Action(layer, op, mb))
        if op == TB and layer == 0:
            continue
        row.append(Action(-1, EXCHANGE, number, parts=(Action(layer, ALLREDUCE_AFTER[op], mb),)))
        row.append(Action(-1, EXCHANGE_WAIT, number))
        number += 1
    stages = [StageInfo(layer, 0, 0, layer) for layer in range(plan.layers)]
    return build_program(name, plan.num_ranks, num_microbatches, stages, [list(range(plan.layers))],
                         [0] * num_microbatches, [list(row) for _ in range(plan.num_ranks)], plans=(plan,),
                         params=dict(params or {}), source=source)


class TensorParallel(Family):
    name = TENSOR_PARALLEL
    runs_ops_of = (TENSOR_PARALLEL,)
    stage_checks = False
    frees_values = False
    keeps_own_ops = True
    counts_activations = False

    def plan_of(self, program):
        return next((plan for plan in program.plans if isinstance(plan, TensorPlan)), None)

    def spec_plan(self, spec):
        return spec.family_declarations.get("tensor")

    def lower(self, spec, costs):
        declared = spec.family_declarations["tensor"]
        program = tensor_program(TensorPlan(declared.layers, spec.num_ranks), spec.num_microbatches, spec.name,
                                 spec.params, spec.path)
        return replace(program, ranks=[[a for a in row if a.is_compute] for row in program.ranks]), program

    def plan_to_json(self, program):
        return {"tensor": {"layers": self.plan_of(program).layers}}

    def plan_from_json(self, data, header):
        raw = data.get("tensor")
        if raw is None:
            return None
        layers = raw.get("layers") if isinstance(raw, dict) else None
        stages, num_ranks = header["stages"], header["num_ranks"]
        if type(layers) is not int or not 1 <= layers <= MAX_TASKS:
            raise ImportError_(f"tensor.layers must be an integer in 1..{MAX_TASKS:,}, got {quote(layers)}")
        if len(stages) != layers:
            raise ImportError_(f"a tensor-parallel program's stages are its layers: {layers} layers, but "
                               f"{len(stages)} stages")
        return TensorPlan(layers, num_ranks)

    def instruction_bounds(self, plan, op, bounds):
        if op not in _PROGRAM_OPS:
            return None
        return tuple(bound if key in RULES[op].fields else 0 for key, bound in zip(("stage", "mb", "peer"), bounds))

    def refuse_memory_budget(self, name):
        return (f"'{name}' is tensor-parallel: every rank keeps one microbatch's activations of every layer; "
                "activation and byte budgets do not apply to it")

    def refuse_search(self, program):
        # The one choice there is, interleaving microbatches so that one's all-reduce overlaps another's
        # task, needs an order the schedule writes, and the family takes none (``tensor_order`` derives it).
        return (f"{program.name or 'this program'} is tensor-parallel: its order is derived (per microbatch, the "
                "forwards up the layers and the backwards down, each waiting on an all-reduce of every rank) and "
                "its schedules write none, so pipec search has no order to choose or write")

    def refuse_torch_csv(self, name):
        return (f"{name} is tensor-parallel (every rank computes a slice of every layer); torch's schedule CSV "
                "moves activations between the stages of one pipeline and has no form for it")

    def refuse_updates(self):
        return "under tensor parallelism every rank steps its slices after the list"

    def shape_text(self, program):
        layers = self.plan_of(program).layers
        return f"{counted(layers, 'layer')} split across every rank, {counted(program.num_microbatches, 'microbatch')}"

    def block_area(self, program, action):
        if action.op in ALLREDUCE_AFTER and 0 <= action.stage < len(program.stages) \
                and 0 <= action.mb < program.num_microbatches:
            return 1  # a whole task: the op's own cost
        return None

    def proof_text(self, program, memory_text):
        return ("each layer's forward and backward once per microbatch on every rank, each on whole inputs (its "
                "all-reduces waited), every partial sum all-reduced once, collectives met in one order, "
                "deadlock-free")


FAMILY = register(TensorParallel(), TensorPlan)
