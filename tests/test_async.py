"""Asynchronous training: optimizer updates in the order (U), weight stashing, PipeDream and PipeDream-2BW.

A forward runs on its stage's newest weights; with ``stash weights [<= K]`` its
backward runs on the same version, kept until then. The version plan
(``compiler/versions.py``) says what every order means; these tests hold it to
PipeDream's counts (stage s of P keeps P - s versions; 2BW: 2), reject orders
whose backward would run on newer weights than its forward (named, located),
hold the simulator to the throughput formulas, and hold training on gloo ranks
to a one-process emulation of the same staleness (``async_reference_run``).
"""
from __future__ import annotations

import functools
import json
import pathlib
import re

import pytest
import torch

from pipec.cli import main
from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_spec, compile_target
from pipec.compiler.emit import program_from_json, program_to_json
from pipec.compiler.simulate import simulate
from pipec.compiler.costs import costs_from_json
from pipec.compiler.ir import Action
from pipec.compiler.versions import flushed_equivalent, flushed_makespan, version_plan
from pipec.errors import EvalError, ImportError_, PipecError, VersionError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import async_reference_run, reference_run
from runtime_util import assert_same_parameters, launch_batch
from source_util import error_of, messages, spec_of

REPO = pathlib.Path(__file__).resolve().parent.parent
# Unit costs: F = 1, B = 2, U = 0.
F, B = 1, 2

# 1F1B without a flush, an update every `every` backwards, `stash weights` as given.
ASYNC = """
schedule planted(P: ranks = 4, N: microbatches = 8, every: int = 1) {{
  stages P
  place stage s on rank s
  {stash}
  order rank r {{
    let warm = min(P - 1 - r, N)
    for m in 0 .. warm     {{ F(r, m) }}
    for i in 0 .. N - warm {{ F(r, warm + i); B(r, i); if (i + 1) % every == 0 {{ U(r, i) }} }}
    for m in N - warm .. N {{ B(r, m); if (m + 1) % every == 0 {{ U(r, m) }} }}
  }}
}}
"""


def compiled(text: str, **params):
    return compile_spec(spec_of(text, **params)).program


def plan_of(name: str, **params):
    return version_plan(compile_target(name, {k: str(v) for k, v in params.items()}).program)


# ---------------------------------------------------------------- the version plan


@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("n_of", [lambda P: 2 * P - 1, lambda P: 2 * P, lambda P: 4 * P + 1])
def test_pipedream_stage_s_keeps_p_minus_s_versions(P, n_of):
    # from 2P - 1 microbatches on, stage 0 reaches the steady state where P microbatches of P versions are in flight
    N = n_of(P)
    plan = plan_of("pipedream", P=P, N=N)
    assert plan.peak_versions == {s: P - s for s in range(P)}
    # every microbatch is a minibatch of its own: update k of every stage applies microbatch k
    assert all([u.applies for u in plan.updates[s]] == [(m,) for m in range(N)] for s in range(P))
    # the forward of microbatch m at stage s runs after min(m, ...) updates: m - (P - 1 - s) of them, once warm
    for s in range(P):
        warm = min(P - 1 - s, N)
        assert [plan.version_of[s, m] for m in range(N)] == [max(0, m - warm) for m in range(N)]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_2bw_keeps_two_versions(P, extra):
    M = P + extra
    plan = plan_of("pipedream_2bw", P=P, M=M, N=3 * M)
    # two versions at every stage but the last, whose backward follows its forward at once
    assert plan.peak_versions == {s: (2 if s < P - 1 else 1) for s in range(P)}
    assert all([u.applies for u in plan.updates[s]] == [tuple(range(k * M, (k + 1) * M)) for k in range(3)]
               for s in range(P))
    # W(t+1) = W(t) - lr * grad(W(t-1)): a backward is never more than one update behind
    for (s, m) in plan.stashed:
        assert plan.version_of[s, m] == m // M - 1 or plan.version_of[s, m] == m // M


def test_a_flushed_program_has_no_plan():
    assert plan_of("1f1b", P=4, N=8) is None
    # an update after the flush: every backward on the weights its forward ran on, nothing stashed
    text = ASYNC.format(stash="")
    plan = version_plan(compiled(text, N=8, every=8))
    assert plan.stashed == frozenset() and set(plan.peak_versions.values()) == {1}


# ---------------------------------------------------------------- named errors


def test_a_backward_on_newer_weights_than_its_forward_is_rejected():
    with pytest.raises(VersionError) as info:
        check_all(compiled(ASYNC.format(stash=""), N=8))
    error = info.value
    assert (error.rank, error.step) == (0, 13)
    assert error.message.startswith("0B1 would run on version 1 of stage 0's weights, but its forward 0F1 ran on "
                                    "version 0: the stage keeps no older version: declare `stash weights`")
    assert error.render().startswith("rank 0, step 13: 0B1 would run") and "[0B1]" in error.render()


def test_a_bound_too_small_for_the_order_is_rejected():
    # 2BW's double buffer with an update every other microbatch, on 4 ranks: stage 0 needs 3 versions
    with pytest.raises(VersionError) as info:
        compiled(ASYNC.format(stash="stash weights <= 2"), N=8, every=2)
    assert info.value.message == (
        "0B4 would run on version 2 of stage 0's weights, but its forward 0F4 ran on version 0: the stage keeps "
        "only its 2 newest versions (`stash weights <= 2`): raise the bound, or update less often")
    # the same order with the bound its plan needs compiles
    plan = version_plan(compiled(ASYNC.format(stash="stash weights <= 3"), N=8, every=2))
    assert plan.peak_versions == {0: 3, 1: 2, 2: 2, 3: 1}


def test_a_gradient_no_update_applies_is_rejected():
    text = ASYNC.format(stash="stash weights").replace("(m + 1) % every == 0", "m < N - 1")
    with pytest.raises(VersionError, match=r"the weight gradient 0B7 makes is never applied: no update of stage 0 "
                                           r"follows it on rank 0 \(write U\(0, m\) after"):
        compiled(text, N=8)


def test_an_update_of_a_replicated_stage_is_rejected():
    text = """
    schedule two(P: ranks = 2, N: microbatches = 2) {
      stages 2
      pipelines 2
      route microbatch m to pipeline m % 2
      place stage s of pipeline p on rank p == 0 ? s : 1 - s
      stash weights
      order rank r {
        F(0, r); F(1, 1 - r); B(1, 1 - r); U(1, 1 - r); B(0, r); U(0, r)
      }
    }
    """
    with pytest.raises(VersionError, match="updates stage .*, which is replicated"):
        compiled(text)


def test_stash_declarations_are_checked_where_they_are_written():
    text = ASYNC.format(stash="stash weights <= every - 1")
    error = error_of(EvalError, text, every=1)
    assert (error.span.line, error.message) == (5, "the most weight versions must be at least 1, got 0")
    twice = ASYNC.format(stash="stash weights\n  stash weights <= 2")
    assert messages(error_of(PipecError, twice)) == [(6, 3, "`stash weights` is already declared at line 5")]
    ring = """
    schedule r(P: ranks = 2) {
      sequence chunks 2 * P
      hold chunk c on rank c < P ? c : 2 * P - 1 - c
      stash weights
    }
    """
    assert any("`stash weights` belongs to activation passing" in text
               for _, _, text in messages(error_of(PipecError, ring)))


def test_updates_belong_to_activation_passing(tmp_path, capsys):
    # an update written into WeiPipe's order: an error at the task
    source = (REPO / "schedules" / "weipipe.pipe").read_text()
    backward = "B(P - 1 - k % P, r + (k / P - 1) * P)"
    path = tmp_path / "wu.pipe"
    path.write_text(source.replace(backward, f"{backward}; U(P - 1 - k % P, r + (k / P - 1) * P)"))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert re.match(rf"{re.escape(str(path))}:34:\d+: U\(\.\.\.\) updates a stage's weights inside the order, "
                    "and under weight passing each layer's owner steps its optimizer after the list", err), err
    # ... and in a program file, where no source can say so: at the instruction
    data = program_to_json(compile_target("weipipe", {}).program)
    row = data["ranks"][0]
    row.insert(len(row) - 1, {"op": "U", "text": "0U0", "stage": 0, "mb": 0})
    with pytest.raises(VersionError, match="0U0 updates a stage inside the list, but under weight passing"):
        check_all(program_from_json(data))


def test_weight_versions_round_trip_through_json():
    for stash, want in (("stash weights", None), ("stash weights <= 3", 3), ("", 1)):
        program = compiled(ASYNC.format(stash=stash), N=8, every=8 if not stash else 2)
        data = program_to_json(program)
        assert ("weight_versions" in data) == (want != 1)
        assert program_from_json(json.loads(json.dumps(data))).weight_versions == want
    data = program_to_json(compiled(ASYNC.format(stash="stash weights"), N=8))
    for bad in (0, "2", 1.5):
        with pytest.raises(ImportError_, match="weight_versions"):
            program_from_json({**data, "weight_versions": bad})
    # a hand-edited file that keeps fewer versions than its order needs fails the check, located
    with pytest.raises(VersionError, match="keeps only its 2 newest"):
        check_all(program_from_json({**data, "weight_versions": 2}))


# ---------------------------------------------------------------- the simulator


@pytest.mark.parametrize("P,N", [(2, 8), (4, 16), (4, 32), (8, 32)])
def test_no_flush_gains_the_bubble_of_every_update(P, N):
    # N microbatches take (N + P - 1)(F + B), with an update after every backward (PipeDream) ...
    pipedream = compile_target("pipedream", {"P": str(P), "N": str(N)})
    assert simulate(pipedream.program).makespan == (N + P - 1) * (F + B)
    # ... where updating as often with a flush (1F1B, one microbatch per step) takes N P (F + B)
    flushed = simulate(compile_target("1f1b", {"P": str(P), "N": "1"}).program)
    assert flushed.makespan == P * (F + B)
    # 2BW: the same makespan for N / M updates, where 1F1B with M microbatches per step takes (M + P - 1)(F + B) each
    M = P
    two_bw = compile_target("pipedream_2bw", {"P": str(P), "M": str(M), "N": str(N)})
    assert simulate(two_bw.program).makespan == (N + P - 1) * (F + B)
    assert simulate(compile_target("1f1b", {"P": str(P), "N": str(M)}).program).makespan == (M + P - 1) * (F + B)
    # the simulator's flushed equivalent: the same order, each minibatch drained before the next
    for program, per_update in ((pipedream.program, P * (F + B)), (two_bw.program, (M + P - 1) * (F + B))):
        plan = version_plan(program)
        parts = flushed_equivalent(program, plan)
        assert len(parts) == len(plan.updates[P - 1]) == N // len(plan.updates[P - 1][0].applies)
        assert [simulate(part).makespan for part in parts] == [per_update] * len(parts)


# Costs whose sums are inexact in floating point, with links, so that the order of a sum shows.
FLOAT_COSTS = {"compute": {"F": 0.1, "B": 0.3, "U": 0.07, "per_chunk": {"1": {"F": 0.13}}},
               "links": {"latency": 0.01, "bandwidth": 100.0, "bytes": {"act": 4.0, "grad": 4.0}, "node_size": 2,
                         "inter_node": {"latency": 0.05, "bandwidth": 25.0}}}


def _asynchronous_programs():
    """Small programs of both PipeDream schedules and a planted order updating every 2 or 4 backwards."""
    for P in (2, 3, 4, 5):
        for N in sorted({1, P - 1, P, 2 * P + 1, 16} - {0}):
            yield compile_target("pipedream", {"P": str(P), "N": str(N)}).program
        for M in (P, P + 1, 2 * P):
            yield compile_target("pipedream_2bw", {"P": str(P), "M": str(M), "N": str(M * (16 // M))}).program
        for every in (2, 4):
            yield compiled(ASYNC.format(stash="stash weights"), P=P, N=16, every=every)


def _reference_flushed(program, plan):
    """``flushed_equivalent`` as first written: per update of the last stage, every rank's compute tasks of
    its microbatches, numbered as in the program (each update filters the whole program)."""
    import dataclasses
    out = []
    for update in plan.updates.get(program.pipelines[0][-1], ()):
        rows = [[a for a in row if a.is_compute and a.mb in update.applies] for row in program.ranks]
        out.append(dataclasses.replace(program, ranks=rows, communicators=list(program.communicators)))
    return out


def _reference_peak_versions(program):
    """The most versions each stage keeps at once, walked the straightforward way: after every task of the
    stage, the versions of its microbatches in flight (forward ran, weight gradient not made) and its newest."""
    from pipec.compiler import ops
    forward = {op for op, way in ops.WEIGHT_PASS.items() if way == ops.FORWARD}
    backward = {op for op, way in ops.WEIGHT_PASS.items() if way == ops.BACKWARD}
    peak = {}
    for row in program.ranks:
        newest, in_flight = {}, {}
        for stage, op, mb, _, _ in row:
            if op in ops.UPDATE_OPS:
                newest[stage] = newest.get(stage, 0) + 1
            elif op in forward:
                in_flight.setdefault(stage, {})[mb] = newest.get(stage, 0)
            elif op in backward:
                if op in ops.GRADIENT_CONTRIBUTORS:
                    in_flight.get(stage, {}).pop(mb, None)
            else:
                continue
            kept = len(set(in_flight.get(stage, {}).values()) | {newest.get(stage, 0)})
            peak[stage] = max(peak.get(stage, 0), kept)
    return peak


def test_the_flushed_comparison_equals_its_straightforward_form():
    # flushed_makespan simulates each distinct minibatch once, its microbatches renumbered from 0: the same
    # programs up to that numbering, the same sum in the same order, under unit and floating-point costs
    float_costs = costs_from_json(FLOAT_COSTS)
    for program in _asynchronous_programs():
        plan = version_plan(program)
        reference = _reference_flushed(program, plan)
        parts = flushed_equivalent(program, plan)
        assert len(parts) == len(reference)
        for part, whole in zip(parts, reference):
            members = sorted({a.mb for row in whole.ranks for a in row})
            assert part.num_microbatches == len(members)
            assert part.ranks == [[Action(a.stage, a.op, members.index(a.mb)) for a in row] for row in whole.ranks]
        for costs in (None, float_costs):
            expected = sum(simulate(each, costs).makespan for each in reference)
            assert flushed_makespan(program, plan, costs) == expected, program.name
            assert type(flushed_makespan(program, plan, costs)) is type(expected)


def test_the_version_walk_equals_its_straightforward_form():
    for program in _asynchronous_programs():
        assert version_plan(program).peak_versions == _reference_peak_versions(program), program.name


def test_simulate_and_check_report_updates_and_versions(capsys):
    assert main(["simulate", "pipedream_2bw", "-D", "P=4", "-D", "N=16"]) == 0
    out = capsys.readouterr().out
    assert "makespan 57," in out
    assert "updates per stage [4, 4, 4, 4]: one every 14.25 on average; weight versions per stage [2, 2, 2, 1]" in out
    assert "with a flush after every update: makespan 84; without, 1.474 times the throughput" in out
    assert main(["simulate", "pipedream", "-D", "P=4", "-D", "N=8", "--json"]) == 0
    versions = json.loads(capsys.readouterr().out)["versions"]
    assert versions == {"updates": [8, 8, 8, 8], "weight_versions": [4, 3, 2, 1], "stashed": 21,
                        "flushed_makespan": 8 * 4 * (F + B)}
    assert main(["check", "pipedream", "-D", "P=4", "-D", "N=8"]) == 0
    assert "updates per stage [8, 8, 8, 8], weight versions per stage [4, 3, 2, 1]" in capsys.readouterr().out


def test_the_cli_names_a_version_error(tmp_path, capsys):
    path = tmp_path / "planted.pipe"
    path.write_text(ASYNC.format(stash="stash weights <= 2"))
    assert main(["check", str(path), "-D", "every=2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rank 0, step 26: 0B4 would run on version 2 of stage 0's weights")
    assert "Traceback" not in err


def test_clipping_is_refused_for_a_program_with_updates(capsys):
    assert main(["run", "pipedream", "-D", "N=8", "--clip-grad-norm", "1"]) == 1
    assert "--clip-grad-norm clips a whole step's gradients" in capsys.readouterr().err


# ---------------------------------------------------------------- training on gloo ranks

STEPS, SEED, N = 6, 5, 8
# (schedule, its -D defines)
RUNS = {"pipedream": ["-D", f"N={N}"], "pipedream_2bw": ["-D", f"N={N}", "-D", "M=4"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("async_runs")
    jobs, saves = [], {}
    for name, defines in RUNS.items():
        template = str(folder / f"{name}-{{step}}.pt")
        saves[name] = template.format(step=STEPS)
        # a checkpoint after step 3 too, for the resumed run below
        jobs.append([name, "-D", "P=4", *defines, "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60",
                     "--save", template, "--save-every", "3"])
    # pipedream resumed after step 3: updates and stashes start over at a step boundary
    resumed = str(folder / "resumed.pt")
    jobs.append(["pipedream", "-D", "P=4", *RUNS["pipedream"], "--steps", str(STEPS), "--timeout", "60",
                 "--resume", str(folder / "pipedream-3.pt"), "--save", resumed])
    return launch_batch(jobs, 4, 240.0), saves, resumed


@functools.cache
def _emulated(name: str):
    defines = dict(d.split("=") for d in RUNS[name][1::2])
    program = compile_target(name, {"P": "4", **defines}).program
    return async_reference_run(program, ModelConfig(), STEPS, SEED)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_asynchronous_training_equals_its_one_process_emulation(trained, name):
    run, saves, _ = trained
    assert run.ok, run.describe()
    want = _emulated(name)
    got = torch.load(saves[name], weights_only=True)
    assert_same_parameters(got, want.state_dict, f"{name} P=4")
    # the staleness is real: synchronous training on the same batches ends elsewhere
    sync = reference_run(ModelConfig(), STEPS, N, SEED).state_dict
    assert max((got[k] - sync[k]).abs().max().item() for k in got) > 1e-2
    # the loss falls on the built-in task
    assert want.losses[-1] < 0.5 * want.losses[0]


def test_the_run_prints_the_emulated_losses(trained):
    run, _, _ = trained
    printed = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", run.stdout[0], re.M)]
    want = _emulated("pipedream").losses + _emulated("pipedream_2bw").losses
    assert printed[:2 * STEPS] == pytest.approx(want, abs=1e-5)


def test_an_asynchronous_run_resumes_at_a_step_boundary(trained):
    run, _, resumed = trained
    assert run.ok, run.describe()
    assert_same_parameters(torch.load(resumed, weights_only=True), _emulated("pipedream").state_dict,
                           "pipedream 3 + 3 steps")
