"""Split backward: I computes a stage's input gradient, W later its weight gradients, with no work done twice.

A B does two things at once: it carries the output gradient back to the
stage's input (what the previous stage waits for) and, on the way, into every
parameter. Zero-bubble schedules run the first part as I and delay the second
as W. Running W as a second backward from the stage's output would walk the
whole input path again, so that I + W costs about 1.5 B. Instead
``input_grad`` (I) walks the graph once, records the gradient arriving at each
*branch node* (where a path to a parameter leaves the input path) and returns
the input gradient with a ``PendingWeightGrad``; ``weight_grad`` (W) computes
from those records only the parameter branches. The result is exact, shared
weights and several inputs or outputs (payloads) included; each function's
docstring says how, and docs/runtime.md, "Split backward (I and W)", what it
costs.

The idea is the one of torch.distributed.pipelining's ``stage_backward_input``
and ``stage_backward_weight``; this is an independent implementation of it.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import NamedTuple, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


class BranchGroup(NamedTuple):
    """Branch nodes that reach the same parameters, the gradients recorded at them, and those parameters."""

    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None]
    params: list[torch.Tensor]


class PendingWeightGrad(NamedTuple):
    """What I leaves for W: the branch groups, or (first stage) the outputs and their gradients."""

    groups: list[BranchGroup]
    outputs: list[torch.Tensor]
    output_grads: list[torch.Tensor] | None
    params: Sequence[torch.Tensor]


def _as_list(tensors) -> list[torch.Tensor]:
    """One tensor, a sequence of them, or None, as a list."""
    if tensors is None:
        return []
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The autograd node a gradient for ``tensor`` flows into: its grad_fn, or a leaf's accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    # a leaf's AccumulateGrad node is made lazily; a view's grad_fn points at it
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]


def _consumers(roots: list[Node]) -> tuple[dict[Node, list[Node]], dict[Node, int]]:
    """The reversed graph below ``roots`` (node -> the nodes whose backward feeds it), and each node's discovery rank."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    rank = {root: i for i, root in enumerate(dict.fromkeys(roots))}
    queue = deque(rank)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in rank:
                rank[child] = len(rank)
                queue.append(child)
    return consumers, rank


def _upward(starts: list[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` toward the outputs, not entering ``stop``; and the ``stop`` nodes met."""
    reached, met = set(starts), set()
    queue = deque(reached)
    while queue:
        for parent in consumers.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


def _branch_groups(outputs: list[torch.Tensor], leaves: list[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> list[BranchGroup]:
    """The parameters grouped by the branch nodes they share (transitively), nodes in a fixed order."""
    consumers, rank = _consumers([output.grad_fn for output in outputs])
    input_path, _ = _upward([_node_of(leaf) for leaf in leaves], consumers, set())
    owner: dict[Node, int] = {}  # branch node -> its group's index in members / nodes
    members: list[list[torch.Tensor]] = []
    nodes: list[set[Node]] = []
    for param in params:
        accumulator = _node_of(param)
        if accumulator not in consumers:
            continue  # this output does not use it: no gradient, as in a plain backward
        _, branches = _upward([accumulator], consumers, input_path)
        joined = sorted({owner[n] for n in branches if n in owner})
        members.append([param] + [p for g in joined for p in members[g]])
        nodes.append(branches.union(*(nodes[g] for g in joined)))
        for g in joined:
            members[g], nodes[g] = [], set()
        for node in nodes[-1]:
            owner[node] = len(nodes) - 1
    return [
        BranchGroup(ordered, [None] * len(ordered), params_of)
        for params_of, group in zip(members, nodes)
        if params_of
        for ordered in [sorted(group, key=rank.__getitem__)]
    ]


def input_grad(output, output_grad, leaf, params: Sequence[torch.Tensor]):
    """I: the gradient of the stage's input(s), and what W needs.

    Walks the autograd graph once (no compute) to find the *branch nodes*: the nodes on the
    path from the stage's input to its output where a path to a parameter leaves it (for
    ``x @ W.T`` the matmul's backward, whose other input leads through a transpose to W's
    accumulator). It hooks them, computes the input gradient with the graph kept, and so
    records the gradient that arrived at each branch node. A stage may read several input
    tensors and make several outputs (a payload: ``runtime/payload.py``); the input path is
    then the union of the paths from every input that carries a gradient to any output. A
    stage with no such input (a pipeline's first stage) has no input path: I has nothing to
    compute, and W is the whole backward into the parameters.

    Args:
        output: the stage's output tensor (or its scalar loss, then ``output_grad``
            is None), or a sequence of output tensors.
        output_grad: the gradient of ``output`` (a tensor, or one per output).
        leaf: the stage's input, a leaf that requires grad, or a sequence of
            them; None (or empty) for a first stage.
        params: the stage's trainable parameters.
    Returns:
        (the input gradient: a tensor when ``leaf`` is one, a list (zeros for an
        input the outputs do not depend on) when ``leaf`` is a sequence, None
        without inputs; the ``PendingWeightGrad`` for W).
    """
    outputs, leaves = _as_list(output), _as_list(leaf)
    grads = None if output_grad is None else _as_list(output_grad)
    if not leaves:
        return None, PendingWeightGrad([], outputs, grads, params)
    groups, found = [], [None] * len(leaves)
    if outputs:  # else no output depends on anything trainable: nothing flows back
        groups = _branch_groups(outputs, leaves, params)
        handles = []
        try:
            for group in groups:
                for i, node in enumerate(group.nodes):
                    handles.append(node.register_prehook(_recorder(group.grads, i)))
            found = torch.autograd.grad(outputs, leaves, grads, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
    found = [g if g is not None else torch.zeros_like(x) for g, x in zip(found, leaves)]
    return (found[0] if isinstance(leaf, torch.Tensor) else found), PendingWeightGrad(groups, [], None, params)


def _recorder(slots: list, i: int):
    def record(grad_outputs):
        slots[i] = grad_outputs

    return record


def weight_grad(pending: PendingWeightGrad) -> None:
    """W: accumulate the stage's weight gradients into each parameter's ``.grad``.

    Starts from the gradients I recorded and asks autograd for the parameters only, one branch
    group at a time, so autograd computes only the parameter branches (for a matmul: the
    weight's product, not the input's again). A parameter used at several places along the
    input path (a shared weight) has a branch node at each; W then also walks the input path
    between them, which it cannot tell autograd to skip, with the incoming gradients of those
    nodes pinned to what I recorded so that nothing counts twice: exact, only not the short path.
    """
    if pending.outputs:
        torch.autograd.backward(pending.outputs, pending.output_grads, inputs=list(pending.params))
        return
    for group in pending.groups:
        edges, grads = [], []
        for node, recorded in zip(group.nodes, group.grads):
            for i, grad in enumerate(recorded or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            continue
        handles = []
        if len(group.nodes) > 1:  # a branch node below another gets exactly what I recorded there
            handles = [node.register_prehook(_pinned(recorded)) for node, recorded in zip(group.nodes, group.grads)
                       if recorded is not None]
        try:
            results = torch.autograd.grad(edges, group.params, grads, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for param, result in zip(group.params, results):
            if result is None:
                continue
            if param.grad is None:
                param.grad = result
            else:
                param.grad.add_(result)


def _pinned(recorded):
    return lambda grad_outputs: recorded


__all__ = ["BranchGroup", "PendingWeightGrad", "input_grad", "weight_grad"]
