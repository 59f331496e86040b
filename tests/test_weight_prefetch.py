"""``prefetch K`` on weight passing for every K the step grid allows (issue 26, item 5).

With K >= 2 an exchange stays open K boundaries, which once let the lowering
drop the staging rank's copy of a layer under a broadcast taken from it
(TawPipe, ``prefetch 2``) and add a gradient into a partial still being sent
(TawPipe at G = 4, FSDP with K >= 2L). Here, for the shipped ``tawpipe``
(P in 4, 8; G in 2, 4; K in 1..3), ``fsdp`` (P = 4, L in 2, 4, two
microbatches per rank, K in 1..2L+1) and a direct route written for the test:

* ``-D K=k`` sets the shipped schedules' ``prefetch``;
* the compiled program passes its own check (``compile_spec`` runs every
  check and raises on the first violation);
* the simulated makespan never grows as K grows, under two cost files in
  which a layer's weights take longer to move than a step's compute (what is
  measured: ``simulate(program, costs).makespan``, K = 0 .. the largest);
* one gloo launch of 4 ranks trains ``tawpipe`` with K = 2 and 3 and ``fsdp``
  with K = 2L and 3L (L = 2) for 2 steps to within the tolerance of one process;
* the pass that moves the drops and waits (``weight_hazards``) keeps a drop
  behind the wait of a send from its copy and moves a gradient wait forward.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_spec, resolve_target
from pipec.compiler.emit.json_program import write_program_json
from pipec.compiler.ir import Action
from pipec.compiler.ops import B, BCAST_W, EXCHANGE, EXCHANGE_WAIT, FREE_W, SEND_G
from pipec.compiler.simulate import simulate
from pipec.compiler.weight_hazards import separate_transfers
from pipec.errors import ScheduleError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

# a layer's weights take 0.1 + 1.5 (or 0.5 + 4) time units a hop, against F = 1 and B = 2 or 3
COSTS = {
    "slow links": {"links": {"latency": 0.1, "bandwidth": 1.0}, "sizes": {"weight": 1.5}},
    "slower links": {"links": {"latency": 0.5, "bandwidth": 0.5}, "sizes": {"weight": 2.0},
                     "compute": {"F": 1.0, "B": 3.0}},
}
TAWPIPE = [(P, G) for P in (4, 8) for G in (2, 4) if G <= P]
FSDP_LAYERS = (2, 4)
# A direct route (every rank fetches each layer from its owner), the one route no schedule ships with.
DIRECT = """\
schedule owned(P: ranks = 4, L: chunks = P, N: microbatches = 2 * P) {
  let A = N / P
  stages L
  home microbatch m on rank m % P
  own layer l on rank l % P
  weights direct
  gradients direct
  order rank r {
    for a in 0 .. A {
      let start = a * 2 * L
      for l in 0 .. L { at step start + l { F(l, r + a * P) } }
      for j in 0 .. L { at step start + L + j { B(L - 1 - j, r + a * P) } }
    }
  }
}
"""
STEPS, SEED = 2, 7
BATCH_DEADLINE_S = 300.0


def with_prefetch(spec, prefetch: int):
    return dataclasses.replace(spec, weights=dataclasses.replace(spec.weights, prefetch=prefetch))


def tawpipe(P: int, G: int, prefetch: int):
    """The shipped schedule with ``-D K=prefetch`` (its ``prefetch K``)."""
    spec = resolve_target("tawpipe").evaluate({"P": P, "G": G, "K": prefetch})
    assert spec.weights.prefetch == prefetch
    return spec


def fsdp(L: int, prefetch: int):
    spec = resolve_target("fsdp").evaluate({"P": 4, "L": L, "N": 8, "K": prefetch})
    assert spec.weights.prefetch == prefetch
    return spec


@pytest.fixture(scope="module")
def direct_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "owned.pipe"
    path.write_text(DIRECT)
    return str(path)


def makespans(make, prefetches) -> dict[str, list[float]]:
    """cost set -> the makespan at each prefetch (each program checked as it is compiled)."""
    programs = [compile_spec(make(k)).program for k in prefetches]
    return {name: [simulate(p, costs_from_json(costs)).makespan for p in programs] for name, costs in COSTS.items()}


def assert_never_grows(found: dict[str, list[float]], label: str) -> None:
    for name, spans in found.items():
        assert all(b <= a + 1e-9 for a, b in zip(spans, spans[1:])), f"{label}, {name}: makespans {spans}"
        # the links are slow enough that prefetching pays: the test can see a regression
        assert spans[-1] < spans[0], f"{label}, {name}: prefetch gained nothing: {spans}"


# ------------------------------------------------------------------ checked, and no slower


@pytest.mark.parametrize("P,G", TAWPIPE)
def test_tawpipe_checks_and_gets_no_slower_with_prefetch(P, G):
    assert_never_grows(makespans(lambda k: tawpipe(P, G, k), range(0, 4)), f"tawpipe P={P} G={G}")


@pytest.mark.parametrize("L", FSDP_LAYERS)
def test_fsdp_checks_and_gets_no_slower_with_prefetch(L):
    assert_never_grows(makespans(lambda k: fsdp(L, k), range(0, 2 * L + 2)), f"fsdp L={L}")


def test_direct_route_checks_and_gets_no_slower_with_prefetch(direct_target):
    base = resolve_target(direct_target).evaluate({})
    assert base.weights.route == "direct"
    assert_never_grows(makespans(lambda k: with_prefetch(base, k), range(0, 6)), "direct")


def test_the_ring_still_refuses_prefetch_beyond_one():
    """A ring slot moves one rank a step: K = 2 is outside the grid, refused with a reason, not miscompiled."""
    spec = with_prefetch(resolve_target("weipipe").evaluate({"P": 4}), 2)
    with pytest.raises(ScheduleError, match=r"prefetch 0 or 1"):
        compile_spec(spec)


# ------------------------------------------------------------------ the pass itself


def test_a_drop_waits_for_the_broadcast_taken_from_its_copy():
    """Rank 1 holds layer 3's copy for step 3 (delivered by exchange 0) and broadcasts layer 3 for
    step 11 from it in exchange 2; the drop after step 3 must follow exchange 2's wait."""
    layer_of = lambda action: action.stage  # noqa: E731 - stage id = layer here
    row = [Action(-1, EXCHANGE, 0, parts=(Action(3, BCAST_W, 3, 0),)), Action(-1, EXCHANGE_WAIT, 0),
           Action(-1, EXCHANGE, 2, parts=(Action(3, BCAST_W, 11, 1),)),
           Action(3, FREE_W, 3), Action(-1, EXCHANGE_WAIT, 2)]
    out = [a.text() for a in separate_transfers(row, 1, layer_of, owners=[0, 0, 0, 0])]
    assert out.index("3FREE_W3") > out.index("EXCHANGE_WAIT2"), out
    assert len(out) == len(row)


def test_a_gradient_add_waits_for_the_send_of_its_partial():
    layer_of = lambda action: action.stage  # noqa: E731
    row = [Action(-1, EXCHANGE, 5, parts=(Action(1, SEND_G, 0, 0),)), Action(1, B, 4),
           Action(-1, EXCHANGE_WAIT, 5)]
    out = [a.text() for a in separate_transfers(row, 2, layer_of, owners=[0, 0])]
    assert out == [row[0].text(), "EXCHANGE_WAIT5", row[1].text()], out


# ------------------------------------------------------------------ trains exactly

# K = 2 and 3 for tawpipe; K = 2L and 3L for fsdp (two microbatches a rank: the gradient waits matter)
RUNS = {"tawpipe-prefetch2": tawpipe(4, 2, 2), "tawpipe-prefetch3": tawpipe(4, 2, 3),
        "fsdp-L2-prefetch4": fsdp(2, 4), "fsdp-L2-prefetch6": fsdp(2, 6)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One launch of 4 gloo ranks running both programs; name -> (the run, the saved state path, the program)."""
    folder = tmp_path_factory.mktemp("prefetch_runs")
    jobs, out = [], {}
    for name, spec in RUNS.items():
        program = compile_spec(spec).program
        path = folder / f"{name}.json"
        with open(path, "w") as handle:
            write_program_json(program, handle)
        save = str(folder / f"{name}.pt")
        jobs.append([name, "--program", str(path), "--steps", str(STEPS), "--seed", str(SEED),
                     "--timeout", "90", "--save", save])
        out[name] = (save, program)
    run = launch_batch(jobs, 4, BATCH_DEADLINE_S)
    return {name: (run, save, program) for name, (save, program) in out.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_prefetched_weight_passing_trains_like_one_process(trained, name):
    run, save, program = trained[name]
    assert run.ok, run.describe()
    assert program.weights.prefetch == RUNS[name].weights.prefetch >= 2
    want = reference_run(ModelConfig(), STEPS, program.num_microbatches, SEED).state_dict
    assert_same_parameters(torch.load(save), want, name)
