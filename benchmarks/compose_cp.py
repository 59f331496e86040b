"""PP x CP at scale: TASP inside pipeline stages against a ring (and zigzag) inside them, simulated.

A 1F1B pipeline of PP = 4 stages, each stage's sequences split over a context
group of CP = 8 ranks (``mesh pp = 4, cp = 8``: cp innermost, so a stage's
group is one node of 8 ranks), on 4 nodes joined by rails (device i of every
node on rail i: the pipeline's hand-off from stage s to s + 1 goes from cp
rank c to cp rank c, over rail c). Inside each stage the attention runs one of
three rings over the node (``context over cp ring "..."``): ``ring_attention``
(contiguous chunks: under the causal mask the last member does twice the
mean), ``zigzag_ring`` (balanced chunks, one ring: 8 of the node's 56
directed links busy) and ``tasp`` (balanced chunks, 7 arc-disjoint
Hamiltonian rings: all 56 links busy each step).

Costs (``contention``: transfers sharing a link share its bandwidth): a
stage's F costs 8 and its B 16 (per member 1/8 of that: the stage's work
outside attention); one sequence of the same length in every case: cut in
2 x 8 chunks (zigzag, TASP) a chunk's KV weighs ``--kv`` bytes and a chunk x
chunk attention block costs 1 forward, 2 backward (``AF``, ``AB``); cut in
8 chunks (ring_attention) a chunk is twice as long, its KV twice the bytes
and a block four times the work. An activation weighs ``--act`` bytes;
links inside a node move 1 byte per time unit, rails 1/4.

Prints, per ring: the makespan of one step, its ratio to TASP's, the bubble,
each member's time in a stage's F (the least and the most: zigzag and TASP
balance it, ring_attention does not), and per link class (intra: the
4 x 56 directed links inside nodes; inter: the 4 x 3 directed rail links of
each of the 8 rails) the bytes moved and the utilisation: busy link-time
(bytes / bandwidth) over (links of the class x makespan).

Usage: python benchmarks/compose_cp.py [--kv 1] [--act 2] [--microbatches 8]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from fractions import Fraction

from pipec.compiler.costs import CostModel, Link
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate
from pipec.compiler.traffic import INTER, INTRA

PP, CP, NODE = 4, 8, 8
RINGS = ("tasp", "zigzag_ring", "ring_attention")
INTRA_BANDWIDTH, RAIL_BANDWIDTH = Fraction(1), Fraction(1, 4)
# directed links per class: every ordered pair inside a node; every ordered pair of one rail's devices
LINKS = {INTRA: PP * NODE * (NODE - 1), INTER: NODE * PP * (PP - 1)}
BANDWIDTH = {INTRA: INTRA_BANDWIDTH, INTER: RAIL_BANDWIDTH}

COMPOSITION = """schedule pp_cp(P: int = {pp}, C: int = {cp}, N: microbatches = {n}) {{
  mesh pp = P, cp = C
  pipeline one_f_one_b(P = P, N = N) from "1f1b"
  context over cp ring "{ring}"
}}
"""


Number = int | float | Fraction


def costs(kv: Number, act: Number, scale: int) -> CostModel:
    """The cost model for a ring whose chunks are ``scale`` times as long as zigzag's (module docstring)."""
    return CostModel(ops=(("AB", 2 * scale * scale), ("AF", scale * scale), ("B", 16), ("F", 8), ("I", 8), ("W", 8)),
                     link=Link(0, INTRA_BANDWIDTH), node_size=NODE, rails=Link(0, RAIL_BANDWIDTH),
                     inter_node=Link(0, RAIL_BANDWIDTH), contention=True,
                     message_bytes=(("act", act), ("grad", act)),
                     value_bytes=tuple(sorted((("kv", kv * scale), ("activation", act)))))


def compose(ring: str, microbatches: int, folder: str):
    """The PP x CP program with ``ring`` inside its stages, through the composition language."""
    path = os.path.join(folder, f"pp_cp_{ring}.pipe")
    with open(path, "w") as out:
        out.write(COMPOSITION.format(pp=PP, cp=CP, n=microbatches, ring=ring))
    return compile_target(path).program


def run(ring: str, kv: Number, act: Number, microbatches: int, folder: str) -> dict:
    program = compose(ring, microbatches, folder)
    result = simulate(program, costs(kv, act, 2 * CP // program.stage_ring.rings.chunks))
    makespan = Fraction(result.makespan)
    moved = {link: sum(Fraction(by_link[link]) for by_link in (result.traffic or {}).values())
             for link in (INTRA, INTER)}
    use = {link: moved[link] / BANDWIDTH[link] / (LINKS[link] * makespan) for link in moved}
    forward = [slot.end - slot.start for slot in result.timeline[0] if not slot.is_comm and slot.action.op == "F"]
    members = [next(slot.end - slot.start for slot in lane if not slot.is_comm and slot.action.op == "F")
               for lane in result.timeline[:CP]]
    return {"makespan": makespan, "bubble": result.bubble_ratio, "moved": moved, "use": use,
            "f_min": min(members), "f_max": max(members), "forwards": len(forward)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", type=float, default=1, help="bytes of one zigzag chunk's KV (default 1)")
    parser.add_argument("--act", type=float, default=2, help="bytes of one activation (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    args = parser.parse_args(argv)
    print(f"PP = {PP} x CP = {CP} (1F1B, N = {args.microbatches}), nodes of {NODE} ranks (a cp group per node), "
          f"rails between nodes; kv {args.kv:g}, act {args.act:g} bytes; intra-node links "
          f"{float(INTRA_BANDWIDTH):g}, rails {float(RAIL_BANDWIDTH):g} bytes per time unit")
    with tempfile.TemporaryDirectory() as folder:
        results = {ring: run(ring, Fraction(args.kv), Fraction(args.act), args.microbatches, folder) for ring in RINGS}
    base = results["tasp"]["makespan"]
    print(f"{'ring in stages':>15} {'makespan':>9} {'/ tasp':>7} {'bubble':>7} {'F min':>7} {'F max':>7} "
          f"{'intra bytes':>12} {'intra use':>10} {'inter bytes':>12} {'inter use':>10}")
    for ring, got in results.items():
        print(f"{ring:>15} {float(got['makespan']):>9.1f} {float(got['makespan'] / base):>6.2f}x "
              f"{got['bubble']:>7.3f} {float(got['f_min']):>7.2f} {float(got['f_max']):>7.2f} "
              f"{float(got['moved'][INTRA]):>12.0f} {float(got['use'][INTRA]):>10.3f} "
              f"{float(got['moved'][INTER]):>12.0f} {float(got['use'][INTER]):>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
