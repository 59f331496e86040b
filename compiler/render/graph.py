"""The task dependency graph of a program as Graphviz DOT (template ``taskgraph.dot.j2``), and as PNG.

One cluster per rank holds that rank's instructions in list order (dashed
"order" edges), frees left out. Compute nodes are coloured like timeline boxes;
"data" edges join each compute to the computes whose outputs it reads (its
dataflow inputs, ``ops.DEPENDENCIES``: activation from the previous stage,
gradient from the next, its own forward, its input-gradient for a W), darker
when they cross ranks; other instructions are drawn by their op's category.
For a program that fails the deadlock check, the members of the wait-for cycle
(``DeadlockError.cycle``: (rank, step, what it waits on)) are outlined in red and
each one's wait is a red edge to the member it waits for (the next one in the
cycle), labelled with the wait.

The DOT text needs nothing outside Python; the PNG needs Graphviz's ``dot``
program (Debian: ``apt-get install graphviz``).
"""
from __future__ import annotations

from typing import Sequence

from pipec.compiler import ops
from pipec.compiler.emit.text_grid import rank_labels
from pipec.compiler.ir import Program, stage_tables
from pipec.compiler.render import style
from pipec.compiler.render._templates import render
from pipec.compiler.render.model import format_params
from pipec.errors import UsageError

# Graphviz lays out a few thousand nodes in seconds; far more takes minutes.
MAX_PNG_NODES = 4000

# Op category -> how its instruction is drawn: a node of a kind of _NODE_STYLES,
# or None for memory bookkeeping (no dependency to see). A compute's data edges
# come from ops.DEPENDENCIES.
_NODE_OF_CATEGORY = {
    ops.COMPUTE: "compute",
    ops.SEND: "comm",
    ops.RECV: "comm",
    ops.BATCH_OF: "comm",
    ops.COLLECTIVE: "comm",
    ops.COLLECTIVE_WAIT: "comm",
    ops.FREE: None,
    # weight passing: an exchange (its parts drawn in it) and its wait; a dropped copy is bookkeeping
    ops.EXCHANGE_OF: "comm",
    ops.EXCHANGE_WAIT_OF: "comm",
    **{category: "comm" for category in ops.EXCHANGE_PART_CATEGORIES},
    ops.DROP_COPY: None,
}
# op -> its node kind (None: not drawn)
_NODE_OF = {op: _NODE_OF_CATEGORY[rule.category] for op, rule in ops.RULES.items()
            if rule.category in _NODE_OF_CATEGORY}
ops.declare_pass("task graph", (op for op in _NODE_OF if ops.RULES[op].category != ops.COMPUTE
                                or op in ops.DEPENDENCIES))
# Node kind -> DOT attributes.
_NODE_STYLES = {
    "compute": 'shape=box, style="rounded,filled"',
    "comm": 'shape=box, style="dashed,filled", fontsize=8, color="#888888"',
}
# Edge kind -> DOT attributes.
_EDGE_STYLES = {
    "order": 'style=dashed, color="#bbbbbb", arrowsize=0.4',
    "data": 'color="#333333", penwidth=1.2',
    "local data": 'color="#999999"',
    "wait": f'color="{style.CYCLE_COLOR}", fontcolor="{style.CYCLE_COLOR}", penwidth=2.5, constraint=false',
}
_CYCLE_NODE = f'color="{style.CYCLE_COLOR}", penwidth=3'


def task_graph_dot(program: Program, cycle: Sequence[tuple[int, int, str]] = ()) -> str:
    """The DOT text of ``program``'s task graph.

    Args:
        program: any program (compute-only or with communication).
        cycle: a ``DeadlockError.cycle`` to draw in red; empty for none.
    Returns:
        a ``digraph`` (module docstring); node ids are ``r{rank}_{step}``.
    """
    members = {(rank, step): text for rank, step, text in cycle}
    clusters, where = [], {}
    labels = rank_labels(program)
    for rank, row in enumerate(program.ranks):
        nodes = []
        for step, action in enumerate(row):
            kind = _NODE_OF.get(action.op, "comm")  # an op the table does not know: drawn generically
            if kind is None:
                continue  # memory bookkeeping: no dependency to see
            node = f"r{rank}_{step}"
            is_compute = kind == "compute"
            if is_compute:  # a stage on a group: each member's task reads its own share (``_share_of``)
                where[(action.op, action.stage, action.mb, _share_of(program, action.stage, rank))] = node
            # a batch or an exchange as its parts; a compute with sub-steps as its own text
            shown_parts = action.parts if not is_compute else ()
            text = "\n".join(part.text() for part in shown_parts) if shown_parts else action.text()
            waits = members.get((rank, step))
            tooltip = f"rank {rank}, step {step}: {action.text()}" + (f"; {waits}" if waits else "")
            fill = style.fill_of(action.op, action.mb) if is_compute else ("#ffffff" if waits is None else style.CYCLE_FILL)
            nodes.append((node, _NODE_STYLES[kind], text, tooltip, fill, waits is not None))
        clusters.append({"rank": rank, "label": labels[rank], "nodes": nodes})
    edges = _order_edges(clusters) + _data_edges(program, where) + _wait_edges(cycle)
    heading = f"{program.name} ({format_params(program.params)}): task graph"
    if cycle:
        heading += " - deadlock: the wait-for cycle is in red"
    return render("taskgraph.dot.j2", name=program.name, heading=heading, clusters=clusters, edges=edges,
                  edge_styles=_EDGE_STYLES, cycle_node=_CYCLE_NODE)


def task_graph_png(program: Program, cycle: Sequence[tuple[int, int, str]] = ()) -> bytes:
    """``task_graph_dot`` laid out by Graphviz's ``dot`` program.

    Returns:
        the PNG bytes.
    Raises:
        UsageError: the graph is too large, or ``dot`` is not installed or fails.
    """
    import graphviz

    nodes = sum(1 for row in program.ranks for action in row if _NODE_OF.get(action.op, "comm") is not None)
    if nodes > MAX_PNG_NODES:
        raise UsageError(f"the task graph has {nodes} nodes, too many for a PNG (at most {MAX_PNG_NODES}); "
                         f"write .dot and open it in a viewer, or draw a timeline (.html)")
    try:
        return graphviz.Source(task_graph_dot(program, cycle), engine="dot").pipe(format="png")
    except graphviz.ExecutableNotFound:
        raise UsageError("a .png task graph needs Graphviz's `dot` program (Debian: apt-get install graphviz); "
                         "write .dot instead") from None
    except graphviz.CalledProcessError as error:
        detail = (error.stderr or b"").decode(errors="replace").strip()
        raise UsageError(f"Graphviz's dot failed: {detail or error}") from None


def _order_edges(clusters: list[dict]) -> list[tuple]:
    """Each rank's instructions in list order."""
    edges = []
    for cluster in clusters:
        ids = [node[0] for node in cluster["nodes"]]
        edges += [(a, b, "order", "", "") for a, b in zip(ids, ids[1:])]
    return edges


def _data_edges(program: Program, where: dict) -> list[tuple]:
    """Producer -> consumer for every input a compute reads (``ops.DEPENDENCIES``: the first producer present)."""
    tables = stage_tables(program)
    neighbour = {side: tables.neighbour(side) for side in (ops.SELF, ops.PREV, ops.NEXT)}
    rank_of = lambda node: node.split("_", 1)[0]  # noqa: E731 - "r3" of "r3_17"
    edges = []
    for (op, stage, mb, share), node in where.items():
        for dependency in ops.DEPENDENCIES[op]:
            source_stage = neighbour[dependency.where][stage]
            if source_stage < 0:
                continue
            keys = ((p, source_stage, mb, share) for p in dependency.made_by)
            source = next((where[key] for key in keys if key in where), None)
            if source is not None:
                kind = "local data" if rank_of(source) == rank_of(node) else "data"
                edges.append((source, node, kind, "", ""))
    return edges


def _share_of(program: Program, stage: int, rank: int) -> int:
    """The share of ``stage``'s values ``rank`` takes, as its placement states it (0 on one rank, or for a rank
    outside it): the holder of share i reads share i of its neighbours' values (groups of one size)."""
    info = program.stages[stage] if 0 <= stage < len(program.stages) else None
    return info.placement.share_of(rank) if info is not None and info.placement is not None \
        and rank in info.ranks else 0


def _wait_edges(cycle: Sequence[tuple[int, int, str]]) -> list[tuple]:
    """Each cycle member to the member it waits for: the next one (``DeadlockError.cycle`` follows the waits)."""
    if len(cycle) < 2:
        return []
    nodes = [f"r{rank}_{step}" for rank, step, _ in cycle]
    return [(nodes[i], nodes[(i + 1) % len(nodes)], "wait", "waits", cycle[i][2]) for i in range(len(nodes))]
