"""``pipec rings``: arc-disjoint directed Hamiltonian rings for an all-to-all or rail topology.

    pipec rings N [--json]                       n - 1 rings over N devices
    pipec rings --nodes M --per-node K [--json]  K rings over M nodes of K devices

``--json`` prints ``{"n": ..., "cycles": [[v0, v1, ...], ...]}`` (each ring lists
its vertices once, in order) plus ``complete`` and ``unused_links``; the text
form is a summary: links used and links busy per step against a single ring,
then the rings.
"""
from __future__ import annotations

import json

from pipec.commands._common import write_output
from pipec.compiler.guarded_read import count_arg
from pipec.errors import UsageError


def register(sub) -> None:
    parser = sub.add_parser(
        "rings",
        help="arc-disjoint Hamiltonian rings (TASP): all links of an all-to-all or rail topology at once",
    )
    # counts as every command reads them: plain ASCII digits (not 1_000 or ١٢), within pipec's range
    parser.add_argument("n", nargs="?", type=count_arg, metavar="N", help="number of devices, all-to-all")
    parser.add_argument("--nodes", type=count_arg, metavar="M", help="number of nodes (rail-optimised topology)")
    parser.add_argument("--per-node", type=count_arg, metavar="K", help="devices per node (rail-optimised topology)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.rings import hamiltonian_rings, rail_rings

    shape = (args.nodes, args.per_node)
    if args.n is not None and shape != (None, None):
        raise UsageError("give either N or --nodes M --per-node K, not both")
    if args.n is not None:
        rings, title = hamiltonian_rings(args.n), f"{args.n} devices, all-to-all"
        shape_fields = {}
    elif None not in shape:
        rings, title = rail_rings(*shape), f"{shape[0]} nodes x {shape[1]} devices, rail-optimised"
        shape_fields = {"nodes": shape[0], "per_node": shape[1]}
    else:
        raise UsageError("give N, or both --nodes M and --per-node K")
    if args.json:
        payload = {"n": rings.n, **shape_fields, "cycles": [list(c) for c in rings.cycles]}
        payload.update(complete=rings.unused_links == 0, unused_links=rings.unused_links)
        if rings.note:
            payload["note"] = rings.note
        write_output(json.dumps(payload), None)
        return 0
    write_output(summary(rings, title), None)
    return 0


def summary(rings, title: str) -> str:
    """Text: what the rings use and keep busy, against one ring, then the rings themselves."""
    n, count, links = rings.n, len(rings.cycles), rings.links
    lines = [f"{title}: {count} arc-disjoint directed Hamiltonian rings"]
    lines.append(f"construction: {rings.construction}")
    if rings.note:
        lines.append(f"note: {rings.note}")
    lines.append(f"links used: {rings.arcs_used} of {links} ({_percent(rings.arcs_used, links)}), {rings.unused_links} unused")
    # Every ring moves one chunk across each of its n arcs per step; one ring keeps n links busy.
    lines.append(
        f"links busy per step: {rings.arcs_used} of {links} ({_percent(rings.arcs_used, links)}); "
        f"a single ring: {n} ({_percent(n, links)})" + (f", {count}x fewer" if count > 1 else "")
    )
    width = len(str(count - 1))
    for index, ring in enumerate(rings.cycles):
        lines.append(f"ring {index:>{width}}: " + " ".join(map(str, ring)))
    return "\n".join(lines)


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%"
