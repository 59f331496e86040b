"""A program's mesh against what it places: the coordinates its labels, timelines and errors give are true.

A composed program's mesh (``ir.Mesh``) names its rank axes; the pipeline runs along ``pp``
(``dsl.composition.PP_AXIS``) and every other axis is a data (or context) axis. ``check_mesh`` proves the
mesh says what the program does, so a coordinate a user reads is the one that runs:

* the axes' sizes multiply to the program's ranks, and ``pp`` is one of them;
* a stage placed on a group spans exactly the ranks at one pp coordinate (its group varies along every other
  axis, never along ``pp``);
* a member's share of its stage's values (``Placement.shares``) is its place along the data axes, so a
  hand-off, which the prover routes by shares, keeps every coordinate but ``pp``'s.

Errors name the first rank that contradicts the mesh, with its coordinates.
"""
from __future__ import annotations

from pipec.compiler.ir import Program
from pipec.dsl.composition import PP_AXIS
from pipec.errors import WellFormedError


def check_mesh(program: Program) -> None:
    """Prove ``program.mesh`` agrees with its placements and its members' shares (module docstring); nothing
    without a mesh.

    Raises:
        WellFormedError: at the first rank that contradicts the mesh.
    """
    mesh = program.mesh
    if mesh is None:
        return
    shape = " x ".join(f"{name} {size}" for name, size in mesh.axes)
    if mesh.size != program.num_ranks or PP_AXIS not in mesh.names:
        why = (f"its axes hold {mesh.size} ranks, the program {program.num_ranks}" if mesh.size != program.num_ranks
               else f"it names no pipeline axis `{PP_AXIS}`")
        raise WellFormedError(f"the mesh ({shape}) is not the program's: {why}", None, None)
    data_axes = tuple(name for name in mesh.names if name != PP_AXIS)
    for info in program.stages:
        if info.placement is None:
            continue
        ranks = info.placement.ranks
        if not ranks or any(not 0 <= r < mesh.size for r in ranks):
            continue  # no group of the program's ranks: the placement checks name it
        group = mesh.members(ranks[0], data_axes)
        stray = next((r for r in ranks if r not in group), None)
        if stray is not None or len(ranks) != len(group):
            rank = stray if stray is not None else next(r for r in group if r not in ranks)
            verb = "is one of" if stray is not None else "is not one of"
            raise WellFormedError(
                f"the mesh ({shape}) contradicts the placements: rank {rank} is at {mesh.label(rank)} and {verb} "
                f"the ranks stage {info.id} is placed on ({', '.join(map(str, ranks))}), but a stage's group is "
                f"every rank at one {PP_AXIS} coordinate, and the ranks at {PP_AXIS} "
                f"{mesh.coords(ranks[0])[PP_AXIS]} are {', '.join(map(str, group))}", rank, None, program.grid())
        for place, (rank, share) in enumerate(zip(ranks, info.placement.shares)):
            if share != place:
                raise WellFormedError(
                    f"the mesh ({shape}) contradicts the roles: rank {rank} is at {mesh.label(rank)}, place {place} "
                    f"of stage {info.id}'s group along {', '.join(data_axes)}, but takes share {share} of its values: "
                    "on a mesh a member's share is its place along the data axes, so that its coordinates say what "
                    "it computes", rank, None, program.grid())


__all__ = ["check_mesh"]
