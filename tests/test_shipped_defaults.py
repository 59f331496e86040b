"""Every shipped schedule runs at its defaults: ``pipec run NAME --steps 2`` with the built-in model.

A schedule's defaults are what a new user runs first. For every shipped
schedule, the checks ``pipec run`` makes before any worker starts (the
program, the model against it, a stage group's share of each microbatch's
rows) pass at its defaults, and its workers train 2 steps on gloo to a
finite loss: all of one world size in one set of processes
(``runtime_util.launch_batch``). (1f1b_hsdp's stage groups of 4 ranks did not
split the built-in model's microbatch of 2 rows; it has 4 now.)
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

import pytest

from pipec.cli import build_parser
from pipec.commands.run import check_before_launch
from pipec.compiler.driver import shipped_schedules
from runtime_util import launch_batch

STEPS = 2
DEADLINE_S = 400.0


def _checked() -> dict[int, list[str]]:
    """World size -> the shipped schedules of that many ranks at their defaults, each passing ``pipec run``'s
    checks before launch."""
    by_world: dict[int, list[str]] = defaultdict(list)
    for name in shipped_schedules():
        program, nproc = check_before_launch(build_parser().parse_args(["run", name, "--steps", str(STEPS)]))
        by_world[nproc].append(name)
    return dict(sorted(by_world.items()))


WORLDS = _checked()


def test_every_shipped_schedule_passes_pipec_runs_checks_at_its_defaults():
    assert sum(map(len, WORLDS.values())) == len(shipped_schedules()), WORLDS


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_every_shipped_schedule_trains_at_its_defaults(world):
    names = WORLDS[world]
    run = launch_batch([[name, "--steps", str(STEPS), "--timeout", "120"] for name in names], world, DEADLINE_S)
    assert run.ok, run.describe()
    losses = [float(loss) for loss in re.findall(r"^step \d+ loss (\S+)$", run.stdout[0], re.M)]
    assert len(losses) == STEPS * len(names) and all(map(math.isfinite, losses)), run.describe()
    assert run.stdout[0].count(" done") == len(names), run.describe()
