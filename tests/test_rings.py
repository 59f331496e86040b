"""Hamiltonian ring decompositions (TASP): complete digraphs, the two exceptions, rail topologies, the CLI.

Every property is checked here by code independent of ``compiler/rings.py``
(``arc_report``, ``hamiltonian_cycles``, ``has_path_decomposition``), and the
module's own checker is shown to reject broken sets.
"""
from __future__ import annotations

import itertools
import json

import pytest

from pipec.cli import main
from pipec.compiler import rings as R
from pipec.errors import UsageError

ALL_N = [n for n in range(2, 129) if n not in (4, 6)]


def arcs_of(ring):
    return list(zip(ring, list(ring[1:]) + [ring[0]]))


def arc_report(n, cycles):
    """(every ring a permutation of 0..n-1, number of arcs used twice, set of arcs used)."""
    permutations = all(sorted(ring) == list(range(n)) for ring in cycles)
    seen, twice = set(), 0
    for ring in cycles:
        for arc in arcs_of(ring):
            twice += arc in seen
            seen.add(arc)
    return permutations, twice, seen


def hamiltonian_cycles(n, allowed=lambda a, b: True):
    """Every directed Hamiltonian cycle on 0..n-1 whose arcs are allowed, listed from vertex 0."""
    out = []
    for rest in itertools.permutations(range(1, n)):
        ring = (0,) + rest
        if all(allowed(a, b) for a, b in arcs_of(ring)):
            out.append(ring)
    return out


def has_path_decomposition(k):
    """Exhaustive: can K*_k be split into k arc-disjoint directed Hamiltonian paths?"""
    paths = [p for p in itertools.permutations(range(k))]
    by_start = {v: [(p, set(zip(p, p[1:]))) for p in paths if p[0] == v] for v in range(k)}

    def extend(vertex, used):  # each vertex starts exactly one path (out-degree count)
        if vertex == k:
            return True
        return any(not (arcs & used) and extend(vertex + 1, used | arcs) for _, arcs in by_start[vertex])

    return extend(0, set())


# --------------------------------------------------------------- complete digraphs


@pytest.mark.parametrize("n", ALL_N)
def test_every_n_splits_into_n_minus_1_arc_disjoint_hamiltonian_rings(n):
    cycles = R.decompose(n)
    permutations, twice, used = arc_report(n, cycles)
    assert len(cycles) == n - 1
    assert permutations, "every ring lists each vertex exactly once"
    assert twice == 0, "no arc used twice"
    assert used == {(a, b) for a in range(n) for b in range(n) if a != b}, "every arc used"
    R.verify_decomposition(n, cycles)


def test_each_family_is_built_by_its_construction():
    families = {7: "prime", 2: "prime", 9: "Walecki", 15: "Walecki", 8: "cut and insert", 12: "cut and insert",
                10: "tabled cuts", 14: "doubling", 18: "doubling", 126: "doubling", 128: "cut and insert"}
    for n, word in families.items():
        assert word in R.construction_name(n), (n, R.construction_name(n))


@pytest.mark.parametrize("n", [8, 12, 16, 40, 128])
def test_cut_and_insert_keeps_the_odd_rings_and_adds_one(n):
    # n % 4 == 0: removing the new vertex n-1 from ring i gives Walecki's ring i of K*_{n-1}.
    walecki = R._rotational_rings(n - 1)
    cycles = R.decompose(n)
    for ring, base in zip(cycles, walecki):
        rest = [v for v in ring if v != n - 1]
        start = rest.index(n - 2)
        assert tuple(rest[start:] + rest[:start]) == base


@pytest.mark.parametrize("n", [14, 18, 30, 126])
def test_doubling_rings_visit_each_half_as_one_block_or_alternate(n):
    m = n // 2
    cycles = R.decompose(n)
    for index, ring in enumerate(cycles):
        halves = [v >= m for v in ring]
        switches = sum(a != b for a, b in zip(halves, halves[1:] + halves[:1]))
        assert switches == (2 if index < m else n), (index, ring)


def test_the_checker_rejects_broken_sets():
    good = [list(c) for c in R.decompose(5)]
    R.verify_decomposition(5, good)
    broken = {
        "repeated vertex": [good[0][:-1] + [good[0][0]]] + good[1:],
        "arc used twice": [good[0], good[0]] + good[2:],
        "one ring missing": good[:-1],
    }
    for what, cycles in broken.items():
        with pytest.raises(ValueError):
            R.verify_decomposition(5, cycles)
    R.verify_decomposition(5, good[:-1], complete=False)  # a partial set is fine when asked for one


def test_a_cold_construction_is_complete_for_every_n_up_to_128():
    # its time is a figure of the machine, not a property: python benchmarks/rings.py prints it per n
    for n in ALL_N:
        R.decompose.cache_clear()
        R.verify_decomposition(n, R.decompose(n))


# ----------------------------------------------------------------- n = 4 and 6


def test_n4_says_no_decomposition_and_gives_the_largest_set():
    with pytest.raises(UsageError, match="no decomposition"):
        R.decompose(4)
    best = R.hamiltonian_rings(4)
    assert "no decomposition" in best.note and "4 of 12 arcs unused" in best.note
    assert len(best.cycles) == 2 and best.unused_links == 4
    permutations, twice, _ = arc_report(4, best.cycles)
    assert permutations and twice == 0
    # Maximal: no three of the six Hamiltonian cycles of K*_4 are arc-disjoint.
    every = hamiltonian_cycles(4)
    assert len(every) == 6
    assert not any(arc_report(4, trio)[1] == 0 for trio in itertools.combinations(every, 3))


def test_n6_says_no_decomposition_and_gives_the_largest_set():
    with pytest.raises(UsageError, match="no decomposition"):
        R.decompose(6)
    best = R.hamiltonian_rings(6)
    assert "no decomposition" in best.note and "6 of 30 arcs unused" in best.note
    assert len(best.cycles) == 4 and best.unused_links == 6
    permutations, twice, _ = arc_report(6, best.cycles)
    assert permutations and twice == 0
    # Maximal: five disjoint rings would use all 30 arcs, and removing vertex 5 would leave
    # five arc-disjoint Hamiltonian paths covering K*_5, which do not exist.
    assert not has_path_decomposition(5)


# ------------------------------------------------------------------- rail topologies


def rail_report(M, K, cycles):
    """Independent check of the multi-node contract; returns a list of violations."""
    problems = []
    permutations, twice, used = arc_report(M * K, cycles)
    if len(cycles) != K:
        problems.append(f"{len(cycles)} rings")
    if not permutations:
        problems.append("a ring is not Hamiltonian")
    if twice:
        problems.append("an arc used twice")
    intra = {(a * K + i, a * K + j) for a in range(M) for i in range(K) for j in range(K) if i != j}
    rails = {(a * K + i, b * K + i) for a in range(M) for b in range(M) for i in range(K) if a != b}
    if not used <= intra | rails:
        problems.append("an arc that is not a link")
    if not intra <= used:
        problems.append("an intra-node arc unused")
    exits = [tail for ring in cycles for tail, head in arcs_of(ring) if tail // K != head // K]
    if M > 1 and sorted(exits) != list(range(M * K)):
        problems.append("a device is not its node's exit exactly once")
    return problems


@pytest.mark.parametrize(
    "shape", [(2, 8), (4, 8), (3, 4), (3, 8), (5, 4), (2, 7), (3, 7), (3, 9), (3, 13), (5, 17), (4, 6), (2, 2), (3, 1)]
)
def test_rail_rings_use_every_intra_node_arc_once_and_each_device_exits_once(shape):
    M, K = shape
    rings = R.rail_rings(M, K)
    assert rings.n == M * K
    assert rail_report(M, K, rings.cycles) == []
    R.verify_rail_rings(M, K, rings.cycles)
    assert rings.links == M * K * (K - 1) + M * (M - 1) * K


@pytest.mark.parametrize("K", range(6, 43, 4))
def test_odd_node_counts_with_k_2_mod_4_use_a_tabled_decomposition_with_an_even_map(K):
    # The closed-form paths map by K/2 transpositions (odd for K % 4 == 2), and an odd
    # number of odd maps cannot compose to the identity: check that, then the tables.
    assert sum(length - 1 for length in cycle_lengths(R._start_to_end(R.path_decomposition(K)))) % 2 == 1
    paths = R._odd_cycle_path_decomposition(K)
    assert len(paths) == K and all(sorted(p) == list(range(K)) for p in paths)
    arcs = [arc for p in paths for arc in zip(p, p[1:])]
    assert len(arcs) == len(set(arcs)) == K * (K - 1)
    assert sorted(p[0] for p in paths) == list(range(K))
    assert all(length % 2 == 1 for length in cycle_lengths(R._start_to_end(paths)))
    for M in (3, 5):
        if M * K <= 128:
            assert rail_report(M, K, R.rail_rings(M, K).cycles) == []


def cycle_lengths(perm):
    seen, lengths = set(), []
    for start in range(len(perm)):
        length, v = 0, start
        while v not in seen:
            seen.add(v)
            v, length = perm[v], length + 1
        if length:
            lengths.append(length)
    return lengths


def test_odd_node_count_beyond_the_tables_is_refused_as_not_implemented_not_impossible():
    with pytest.raises(UsageError, match="no construction is implemented.*K > 42.*may exist"):
        R.rail_rings(3, 46)
    assert R.rail_rings(4, 46).n == 184  # an even number of nodes always works


def test_rail_checker_rejects_broken_rings():
    rings = [list(c) for c in R.rail_rings(2, 4).cycles]
    with pytest.raises(ValueError):
        R.verify_rail_rings(2, 4, rings[:-1])
    swapped = [rings[0][::-1]] + rings[1:]  # reversed: its intra-node arcs belong to other rings
    with pytest.raises(ValueError):
        R.verify_rail_rings(2, 4, swapped)


def rail_sets_exist(M, K):
    """Brute force over every Hamiltonian cycle of the rail topology: is there a valid set of K rings?"""
    link = lambda a, b: a // K == b // K or a % K == b % K
    candidates = hamiltonian_cycles(M * K, link)
    return any(not rail_report(M, K, chosen) for chosen in itertools.combinations(candidates, K))


@pytest.mark.parametrize("shape, reason", [((2, 3), "K\\*_3 has no decomposition"), ((3, 2), "odd number \\(3\\)"),
                                           ((1, 4), "single node has no rails")])
def test_shapes_without_rings_are_refused_with_the_reason(shape, reason):
    with pytest.raises(UsageError, match=reason):
        R.rail_rings(*shape)


def test_the_refused_shapes_really_have_no_rings():
    assert not rail_sets_exist(2, 3)  # 6 devices: every candidate set of 3 rings fails
    assert not rail_sets_exist(3, 2)  # 6 devices: every candidate pair fails
    assert rail_sets_exist(2, 2)  # and the brute force does find rings where they exist
    # K = 3, 5 for any M: inside a node the rings would be a Hamiltonian path decomposition of K*_K.
    assert not has_path_decomposition(3) and not has_path_decomposition(5)
    assert has_path_decomposition(4)
    # M = 1: K rings of K arcs inside one node need K*K arcs; the node has K(K-1).


# ------------------------------------------------------------------------ command


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_json_lists_the_rings(capsys):
    status, out, err = run(capsys, "rings", "8", "--json")
    assert status == 0 and err == ""
    data = json.loads(out)
    assert data["n"] == 8 and len(data["cycles"]) == 7 and data["complete"] is True
    assert arc_report(8, data["cycles"])[2] == {(a, b) for a in range(8) for b in range(8) if a != b}


def test_cli_text_summary_counts_links_against_one_ring(capsys):
    status, out, _ = run(capsys, "rings", "8")
    assert status == 0
    assert "links used: 56 of 56 (100.0%), 0 unused" in out
    assert "links busy per step: 56 of 56 (100.0%); a single ring: 8 (14.3%), 7x fewer" in out
    assert sum(line.startswith("ring ") for line in out.splitlines()) == 7


def test_cli_n6_prints_the_message_and_the_best_set(capsys):
    status, out, _ = run(capsys, "rings", "6")
    assert status == 0
    assert "no decomposition" in out and "6 of 30 arcs unused" in out
    status, out, _ = run(capsys, "rings", "6", "--json")
    data = json.loads(out)
    assert data["complete"] is False and data["unused_links"] == 6 and len(data["cycles"]) == 4


def test_cli_multi_node(capsys):
    status, out, _ = run(capsys, "rings", "--nodes", "4", "--per-node", "8", "--json")
    assert status == 0
    data = json.loads(out)
    assert (data["n"], data["nodes"], data["per_node"]) == (32, 4, 8)
    assert rail_report(4, 8, data["cycles"]) == []
    status, out, _ = run(capsys, "rings", "--nodes", "3", "--per-node", "4")
    assert status == 0 and "links busy per step: 48 of 60" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["rings", "1"], "at least 2 devices"),
        (["rings"], "give N"),
        (["rings", "8", "--nodes", "2", "--per-node", "4"], "not both"),
        (["rings", "--nodes", "3", "--per-node", "2"], "cannot close"),
        (["rings", "--nodes", "2", "--per-node", "5"], "K\\*_5 has no decomposition"),
        (["rings", "--nodes", "0", "--per-node", "4"], "at least 1 node"),
        (["rings", "5000"], "at most"),
    ],
)
def test_cli_errors_exit_1_with_a_message_and_no_traceback(capsys, argv, message):
    import re

    status, out, err = run(capsys, *argv)
    assert status == 1 and out == ""
    assert re.search(message, err) and "Traceback" not in err
