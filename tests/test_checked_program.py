"""No unchecked program runs (issue 24, item 3): a ``--program`` file the checks reject is refused on every rank.

The runtime cannot tell two equal-sized tensors apart: a weight-passing
program whose rank 1 takes its two weight slots of one exchange in the other
order, or whose rank 0 takes two gradient partials in the other order, trains
without a fault, to the wrong parameters. Only the proof protects the user, so
the worker's rank 0 checks a program file (``worker.program_refusal``) and the
ranks share the verdict in their first collective, where they also agree that
they hold one program (``agreement.check_same_training``).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import write_program_json
from pipec.errors import ProgramError
from runtime_util import launch_workers

# A whole 2-rank run: two workers' start-up (torch's imports) and a check.
DEADLINE_S = 240.0


def _owned_by_rank_zero(tmp_path: Path) -> str:
    """The shipped weipipe.pipe with every layer owned by rank 0."""
    source = (Path(__file__).parent.parent / "schedules" / "weipipe.pipe").read_text()
    owners = "own layer l on rank (P - l) % P"
    assert owners in source
    path = tmp_path / "weipipe_rank0_owns.pipe"
    path.write_text(source.replace(owners, "own layer l on rank 0"))
    return str(path)


def _with_row(program, rank: int, row: list):
    ranks = list(program.ranks)
    ranks[rank] = row
    return replace(program, ranks=ranks)


def swapped_weight_receives(tmp_path: Path):
    """Rank 1 takes its forward and backward weight slots (two equal-sized layers) of one exchange in the
    other order."""
    program = compile_target(_owned_by_rank_zero(tmp_path), {"P": 2, "N": 4}).program
    row = list(program.ranks[1])
    index = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE
                 and {part.op for part in a.parts} == {ops.SHIFT_F, ops.SHIFT_B})
    row[index] = row[index]._replace(parts=tuple(reversed(row[index].parts)))
    return _with_row(program, 1, row)


def swapped_gradient_receives(tmp_path: Path):
    """Rank 0 (every layer's owner) takes the first two gradient partials rank 1 sends it in the other order."""
    program = compile_target(_owned_by_rank_zero(tmp_path), {"P": 2, "N": 4}).program
    row = list(program.ranks[0])
    first, second = [i for i, a in enumerate(row) if a.op == ops.EXCHANGE
                     and any(part.op == ops.SHIFT_G for part in a.parts)][:2]
    row[first], row[second] = row[second], row[first]
    return _with_row(program, 0, row)


def swapped_activation_sends(tmp_path: Path):
    """tests/test_checks.py's hazard, on the compiled gpipe: rank 0 sends microbatch 1's and 2's activations
    in the other order."""
    program = compile_target("gpipe", {"P": 2, "N": 4}).program
    row = list(program.ranks[0])
    texts = [action.text() for action in row]
    first, second = texts.index("0SEND_F1"), texts.index("0SEND_F2")
    row[first], row[second] = row[second], row[first]
    return _with_row(program, 0, row)


def _write(program, path: Path) -> str:
    with open(path, "w") as handle:
        write_program_json(program, handle)
    return str(path)


@pytest.mark.parametrize("make", [swapped_weight_receives, swapped_gradient_receives, swapped_activation_sends])
def test_a_program_file_the_checks_reject_is_refused_on_every_rank_before_any_step(tmp_path, make):
    program = make(tmp_path)
    with pytest.raises(ProgramError) as caught:
        check_all(program, semantics="rendezvous")
    said = caught.value.render().splitlines()[0]  # "rank R, step S: ...", the grid window below it
    path = _write(program, tmp_path / "program.json")
    save = tmp_path / "model.pt"
    run = launch_workers([program.name, "--program", path, "--steps", "2", "--save", str(save)], 2, DEADLINE_S)
    assert not run.timed_out and run.returncodes == [1, 1], run.describe()
    for rank, err in enumerate(run.stderr):
        assert "fails pipec's checks" in err and said in err, f"rank {rank}:\n{run.describe()}"
        assert "Traceback" not in err, run.describe()
        assert not any(line.startswith("step ") for line in run.stdout[rank].splitlines()), run.describe()
    assert not save.exists() and not Path(f"{save}.resume").exists()


class _Stopped(Exception):
    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _plan(program):
    """What ``agreement.what_runs`` reads of a worker's plan, for ``program``."""
    from pipec.runtime.config import RunConfig
    from pipec.runtime.model import LLAMA

    run = RunConfig(target=program.name, steps=2, seed=0)
    return SimpleNamespace(program=program, config=LLAMA.config, run=run, checkpoint=None, spec=LLAMA)


def _agree(monkeypatch, capsys, plans, refusal=None, rank=0):
    """``check_same_training`` on ``rank``, the ranks holding ``plans``, with rank 0's ``refusal``;
    (exit status or None, stderr)."""
    import torch.distributed as dist

    from pipec.runtime import agreement, worker

    def stop(status):
        raise _Stopped(status)

    def alone(out, obj):  # a world of one: the rank's own text, kept for the gather below
        texts.append(obj)
        out[0] = obj

    monkeypatch.setattr(worker, "end_process", stop)
    monkeypatch.setattr(dist, "all_gather_object", alone)
    texts = []
    for index, plan in enumerate(plans):  # what each rank contributes to the gather
        try:
            agreement.check_same_training(plan, 1, refusal if index == 0 else None)
        except _Stopped:
            pass
    capsys.readouterr()

    def gather(out, obj):
        out[:] = texts

    monkeypatch.setattr(dist, "all_gather_object", gather)
    try:
        agreement.check_same_training(plans[rank], len(plans), refusal if rank == 0 else None)
        status = None
    except _Stopped as stopped:
        status = stopped.status
    return status, capsys.readouterr().err


def test_ranks_holding_different_programs_are_refused_naming_the_ranks(monkeypatch, capsys):
    one = compile_target("gpipe", {"P": 2, "N": 4}).program
    other = compile_target("gpipe", {"P": 2, "N": 2}).program
    for rank in (0, 1):
        status, err = _agree(monkeypatch, capsys, [_plan(one), _plan(other)], rank=rank)
        assert status == 1
        assert "the ranks were not started for the same training: rank 0: program gpipe" in err
        assert "; rank 1: program gpipe" in err and "N=2" in err and "N=4" in err


def test_rank_zeros_refusal_stops_every_rank_and_an_accepted_program_goes_on(monkeypatch, capsys):
    program = compile_target("gpipe", {"P": 2, "N": 4}).program
    plans = [_plan(program), _plan(program)]
    for rank in (0, 1):
        status, err = _agree(monkeypatch, capsys, plans, refusal="p.json: refused\nrank 1, step 5: grid", rank=rank)
        assert status == 1 and err == "p.json: refused\nrank 1, step 5: grid\n"
        assert _agree(monkeypatch, capsys, plans, rank=rank) == (None, "")


def test_the_worker_checks_a_program_file_on_rank_zero_only(tmp_path):
    from pipec.runtime.config import RunConfig
    from pipec.runtime.worker import PROGRAM_REFUSED, program_refusal

    bad = swapped_weight_receives(tmp_path)
    config = RunConfig(target="weipipe", program=str(tmp_path / "p\x1b.json"))
    refusal = program_refusal(config, bad, 0)
    assert refusal.startswith(PROGRAM_REFUSED.format(file=str(tmp_path / "p\\x1b.json")) + "\nrank 1, step ")
    assert program_refusal(config, bad, 1) is None  # rank 0's verdict reaches it in the first collective
    assert program_refusal(replace(config, program=None), bad, 0) is None  # compiled: proved by compile_target
    good = compile_target(_owned_by_rank_zero(tmp_path), {"P": 2, "N": 4}).program
    assert program_refusal(config, good, 0) is None
