"""The prover and the runtime agree on every program (issue 26 item 6), on a seeded subset of mutants.

``tests/mutants.py`` holds the mutator and the property; this runs it on ``PER_BASE`` single-edit mutants
of each small program (every shipped composition among them, its roles edited too): every mutant is accepted by ``check_all`` or rejected with a
``ProgramError``; every accepted one trains on gloo (from the program file, without rank 0's check) to
the unmutated program's parameters within 1e-5; a few rejected ones run too, before the accepted ones of
their batch, which must then still train (a fault ends its own job only). ``python tests/mutants.py``
runs the same property over 1,000 mutants per base.
"""
from __future__ import annotations

import collections

import pytest

from mutants import BASES, FAMILIES, Mutant, disagreements, family_mutants, run_programs, runs_for, verdict

PER_BASE = 8
REJECTED_RUNS = 1  # per base program
SEED = 0


@pytest.fixture(scope="module")
def checked() -> list[Mutant]:
    return [verdict(m) for family in FAMILIES for m in family_mutants(family, _count(family), SEED)]


def _count(family: str) -> int:
    return PER_BASE * sum(base.family == family for base in BASES)


@pytest.fixture(scope="module")
def ran(checked, tmp_path_factory):
    chosen = runs_for(checked, REJECTED_RUNS, SEED)
    return chosen, run_programs(chosen, tmp_path_factory.mktemp("mutants"))


def test_every_mutant_is_accepted_or_rejected_with_a_program_error(checked):
    # verdict lets any other exception through: the fixture would have failed with its traceback
    by_family = collections.defaultdict(collections.Counter)
    for mutant in checked:
        by_family[mutant.base.family][mutant.error is None] += 1
    for family in FAMILIES:  # distinct mutants, and both verdicts in every family: the subset tests both ways
        assert sum(by_family[family].values()) == _count(family), family
        assert by_family[family][True] and by_family[family][False], (family, by_family[family])


def test_every_accepted_mutant_trains_exactly_like_its_unmutated_program(ran):
    chosen, outcomes = ran
    assert set(outcomes) == set(BASES)
    for base, (base_outcome, _) in outcomes.items():
        assert base_outcome.kind == "exact", f"{base.label}: {base_outcome}"
    found = [line for base in BASES for line in disagreements(chosen[base], outcomes[base][1])]
    assert not found, "\n".join(found)
    accepted_runs = sum(m.error is None for base in BASES for m in chosen[base])
    assert accepted_runs >= len(BASES), accepted_runs


def test_a_rejected_mutants_fault_ends_its_own_job_and_not_the_batch(ran):
    chosen, outcomes = ran
    rejected = [(base, o) for base in BASES for m, o in zip(chosen[base], outcomes[base][1]) if m.error is not None]
    assert len(rejected) == REJECTED_RUNS * len(BASES)
    assert all(o.kind != "lost" for _, o in rejected), rejected
    # the runtime does notice some of what the checks reject; the accepted runs after it in the batch were exact
    assert any(o.kind in ("fault", "hang", "wrong") for _, o in rejected), rejected
