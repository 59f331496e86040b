"""Arc-disjoint directed Hamiltonian rings: every link of an all-to-all topology at once.

Ring attention moves every KV chunk around one ring, so on a machine where each
of n devices has a direct link to every other it keeps one outgoing link per
device busy out of n - 1. The complete directed graph K*_n splits into n - 1
arc-disjoint directed Hamiltonian cycles for every n >= 2 except 4 and 6
(Tillson, 1980), so n - 1 rings can carry traffic at once, each link carrying
exactly one of them (TASP).

Contract: ``hamiltonian_rings(n)`` returns a ``RingSet`` of n - 1 such rings
(``decompose``), or for n = 4, 6 the largest arc-disjoint set, with a ``note``
that says none exists (``max_disjoint_rings``); ``rail_rings(M, K)`` returns K
rings over M rail-optimised nodes of K devices that use every intra-node arc
exactly once. A ring is a list of the n vertices in ring order, each listed
once; ring ``[v0, v1, ..., v_{n-1}]`` uses the arcs v0 -> v1, ..., v_{n-1} -> v0.

Every construction is a closed form or a table found once, offline, and every
result goes through an independent checker (``verify_decomposition``,
``verify_rail_rings``) before it is returned, so a wrong table or a bug is an
error, never a wrong ring. The constructions, each argued in its function's
docstring: prime n (``_cyclic_rings``), odd n (Walecki, ``_rotational_rings``),
n % 4 == 0 and n = 10 (cut and insert: ``_cut_and_insert``,
``_cut_positions_0mod4``), n % 4 == 2 from 14 (two-node doubling,
``_rings_doubled``, ``_partner_steps``), and for rails ``rail_rings``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations
from math import factorial, gcd
from typing import Callable, Sequence

from pipec.errors import UsageError

Ring = tuple[int, ...]


@dataclass(frozen=True)
class RingSet:
    """Arc-disjoint directed Hamiltonian rings over ``n`` vertices.

    ``links`` counts the directed links of the topology. Every ring moves a
    chunk across each of its ``n`` arcs at every step, so the set keeps
    ``arcs_used`` links busy where a single ring keeps ``n``. ``note`` explains
    a set that cannot cover every link (n = 4, 6).
    """

    n: int
    cycles: tuple[Ring, ...]
    links: int
    construction: str
    note: str = ""

    @property
    def arcs_used(self) -> int:
        return len(self.cycles) * self.n

    @property
    def unused_links(self) -> int:
        return self.links - self.arcs_used


# --------------------------------------------------------------------- checker


def verify_decomposition(n: int, cycles: Sequence[Sequence[int]], complete: bool = True) -> None:
    """Check rings over K*_n independently of how they were built.

    Args:
        n: number of vertices (0 .. n-1).
        cycles: rings, each listing every vertex once, in ring order.
        complete: also require n - 1 rings that together use every arc.
    Returns:
        None. Raises ``ValueError`` naming the first violation.
    """
    used: set[tuple[int, int]] = set()
    everyone = list(range(n))
    for index, ring in enumerate(cycles):
        if sorted(ring) != everyone:
            raise ValueError(f"ring {index} is not a permutation of the {n} vertices: {list(ring)}")
        for arc in _arcs(ring):
            if arc in used:
                raise ValueError(f"arc {arc[0]} -> {arc[1]} is used twice (again by ring {index})")
            used.add(arc)
    if complete:
        if len(cycles) != n - 1:
            raise ValueError(f"{len(cycles)} rings, expected n - 1 = {n - 1}")
        if len(used) != n * (n - 1):
            raise ValueError(f"{len(used)} arcs used, expected n(n-1) = {n * (n - 1)}")


def verify_rail_rings(nodes: int, per_node: int, cycles: Sequence[Sequence[int]]) -> None:
    """Check rings over a rail-optimised topology independently of how they were built.

    Device i of node a is vertex ``a * per_node + i``. Arcs inside a node are
    any ordered pair; between nodes only rails (same device index) exist.

    Args:
        nodes, per_node: the shape (M, K).
        cycles: the rings, each listing all M * K vertices once.
    Returns:
        None. Raises ``ValueError`` unless there are K rings, each Hamiltonian,
        no arc twice, every arc a link, every intra-node arc used exactly once,
        and every device the exit of its node in exactly one ring.
    """
    n = nodes * per_node
    verify_decomposition(n, cycles, complete=False)
    if len(cycles) != per_node:
        raise ValueError(f"{len(cycles)} rings, expected one per device of a node ({per_node})")
    intra = 0
    exits: dict[int, int] = {}
    for index, ring in enumerate(cycles):
        for tail, head in _arcs(ring):
            node_t, dev_t = divmod(tail, per_node)
            node_h, dev_h = divmod(head, per_node)
            if node_t == node_h:
                intra += 1
                continue
            if dev_t != dev_h:
                raise ValueError(f"ring {index}: {tail} -> {head} joins different devices of two nodes (no such link)")
            exits[tail] = exits.get(tail, 0) + 1
    if intra != nodes * per_node * (per_node - 1):
        raise ValueError(f"{intra} intra-node arcs used, expected every one ({nodes * per_node * (per_node - 1)})")
    if nodes > 1:
        for vertex in range(n):
            if exits.get(vertex, 0) != 1:
                raise ValueError(f"device {vertex} is its node's exit in {exits.get(vertex, 0)} rings, expected 1")


def _arcs(ring: Sequence[int]):
    return zip(ring, list(ring[1:]) + [ring[0]])


# ------------------------------------------------------------- odd n (and 2)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _cyclic_rings(n: int) -> list[Ring]:
    """Prime n: ring g steps by g, and every g is a unit, so each ring is Hamiltonian."""
    return [tuple(g * j % n for j in range(n)) for g in range(1, n)]


def _zigzag(N: int) -> list[int]:
    """0, 1, -1, 2, -2, ..., N/2 (mod N), N even: every nonzero difference once."""
    half = N // 2
    out = [0]
    for a in range(1, half):
        out += [a, N - a]
    out.append(half)
    return out


def _rotational_rings(n: int) -> list[Ring]:
    """Odd n (Walecki): vertex n-1 is infinity, ring i is (inf, i + zigzag) over Z_{n-1}.

    The zigzag z = 0, 1, -1, 2, -2, ..., (n-1)/2 and its translates give the rings
    ``(inf, i + z_0, i + z_1, ...)`` for i in Z_{n-1}. Translates i and i + (n-1)/2 are the
    same undirected Hamiltonian cycle run in opposite directions, so these are Walecki's
    (n-1)/2 undirected cycles used both ways.
    """
    N = n - 1
    zig = _zigzag(N)
    return [(N,) + tuple((i + z) % N for z in zig) for i in range(N)]


# ------------------------------------------------------------ even n: cut-and-insert


def _cut_and_insert(n: int, positions: Sequence[int]) -> list[Ring]:
    """Even n from the rotational rings of K*_{n-1}: vertex n-1 goes into one cut arc per ring.

    Args:
        n: even, >= 8.
        positions: for ring i of ``_rotational_rings(n - 1)``, the index p
            (1 .. n-2) of its list such that arc list[p-1] -> list[p] is cut.
    Returns:
        n - 1 rings; the last one is the new vertex followed by the path the
        cut arcs form. Raises ``ValueError`` if the cuts do not form one path
        from infinity through every old vertex (a wrong table, a bug).

    Cutting one arc out of each of the n - 2 rings of K*_{n-1} and putting the new vertex in
    that gap keeps the rings Hamiltonian and disjoint; what must hold is that the n - 2 cut
    arcs (distinct tails, distinct heads) chain into one path that starts at infinity and
    visits every old vertex, because that path, closed through the new vertex, is the last ring.
    """
    new = n - 1
    infinity = n - 2
    base = _rotational_rings(n - 1)
    rings, successor = [], {}
    for ring, p in zip(base, positions):
        successor[ring[p - 1]] = ring[p]
        rings.append((new,) + ring[p:] + ring[:p])
    path = [infinity]
    while path[-1] in successor and len(path) <= n:
        path.append(successor[path[-1]])
    if len(path) != n - 1 or len(set(path)) != n - 1:
        raise ValueError(f"the cut arcs for n = {n} do not form one Hamiltonian path")
    rings.append((new,) + tuple(path))
    return rings


def _cut_positions_0mod4(n: int) -> list[int]:
    """The cuts of ``_cut_and_insert`` for n % 4 == 0 (the ones TASP's public implementation uses).

    With N = n - 2 = 4k + 2, ring i is cut at position 2k of its list (the arc
    (i - k + 1) -> (i + k)); these default cuts alone are translation by 2k - 1, which generates
    Z_N, so they chain into one N-cycle through the finite vertices. Four rings are cut elsewhere
    (ring 0 at its first arc inf -> 0, ring k + 1 at its last finite arc, ring 2k + 2 at position
    3, ring 3k + 2 at position N - 2), which re-routes that cycle into a path from infinity. Here
    they are re-derived in these terms and, as for every construction, checked on every result.
    """
    k = n // 4 - 1
    positions = [2 * k] * (n - 2)
    for ring, p in ((0, 1), (k + 1, 4 * k + 2), (2 * k + 2, 3), (3 * k + 2, 4 * k)):
        positions[ring] = p
    return positions


# n = 10 is too small for the doubling (K*_5 has no Hamiltonian path decomposition);
# this cut table was found once by a small offline search and is checked on every use.
_CUT_POSITIONS_10 = (1, 7, 2, 2, 7, 7, 2, 5)


def _rings_0mod4(n: int) -> list[Ring]:
    return _cut_and_insert(n, _cut_positions_0mod4(n))


def _rings_10(n: int) -> list[Ring]:
    return _cut_and_insert(n, _CUT_POSITIONS_10)


# ------------------------------------------------------- even n: two-node doubling


def _paths_by_removing(rings: Sequence[Ring], vertex: int) -> list[Ring]:
    """Hamiltonian paths of K*_{n-1}: each ring with ``vertex`` taken out, relabelled to 0 .. n-2."""
    paths = []
    for ring in rings:
        at = ring.index(vertex)
        path = ring[at + 1 :] + ring[:at]
        paths.append(tuple(v - (v > vertex) for v in path))
    return paths


def _rings_doubled(n: int) -> list[Ring]:
    """n = 2m, m odd >= 7: m block rings plus m - 1 alternating rings (two-node doubling).

    Split the vertices into two nodes A = 0 .. m-1 and B = m .. 2m-1 (B's x is m + x).
    (1) m "block" rings: take a decomposition of K*_m into m Hamiltonian paths (the rings of
    K*_{m+1} with one vertex removed, built recursively, m + 1 even); a path in A, the rail
    A(end) -> B(end), the same path reversed in B, and the rail B(start) -> A(start). These use
    every arc inside A and inside B and every rail x <-> m + x. (2) m - 1 alternating rings for
    s = 1 .. m - 1: A(x) -> B(x + s) -> A(x + s + t) with t = pi(s) (``_partner_steps``), so
    every non-rail arc between the nodes is used once and each of these rings visits all 2m
    vertices.
    """
    m = n // 2
    paths = _paths_by_removing(decompose(m + 1), _removed_for_doubling(m))
    rings = [path + tuple(m + v for v in reversed(path)) for path in paths]
    partner = _partner_steps(m)
    for s in range(1, m):
        ring, x = [], 0
        for _ in range(m):
            ring += [x, m + (x + s) % m]
            x = (x + s + partner[s]) % m
        rings.append(tuple(ring))
    return rings


def _partner_steps(m: int) -> list[int]:
    """pi as a list (pi[0] unused): pi = -sigma, sigma(s) = s - 1 but sigma(j) = m - 1, sigma(1) = j - 1.

    pi must be a permutation of the nonzero residues mod m with s + pi(s) a unit for every s.
    With j even and j + 1, j - 2 units, s + pi(s) is 1, j + 1 or 2 - j; and sigma has two odd
    cycles, which keeps a vertex whose start -> end map has only odd cycles (what
    ``rail_rings`` needs for an odd number of nodes of n - 1 devices).
    """
    j = next(j for j in range(4, m, 2) if gcd(j + 1, m) == 1 and gcd(j - 2, m) == 1)
    sigma = [0] + [s - 1 for s in range(1, m)]
    sigma[j], sigma[1] = m - 1, j - 1
    return [(-x) % m for x in sigma]


def _removed_for_doubling(m: int) -> int:
    """The vertex of K*_{m+1} left out of node A: m, unless m is the odd-cut vertex to keep."""
    return m if _odd_cut_vertex(m + 1) != m else m - 1


def _odd_cut_vertex(n: int) -> int:
    """A vertex of ``decompose(n)`` (n even) whose removal leaves paths whose start -> end map has only odd cycles.

    Cut and insert: the inserted vertex n - 1. Its rings' neighbours are the
    cut arcs w_j -> w_{j+1} of the path inf = w_0, w_1, ..., w_{n-2}; the map
    sends w_{j+1} to w_j and w_0 to w_{n-2}, one cycle of odd length n - 1.
    Doubling: the odd-cut vertex of K*_{m+1}, kept in node A (renumbered); its
    map there is that one (the removed vertex standing in for B's copy of it)
    next to sigma on node B, and both have only odd cycles.
    """
    if n % 4 == 2 and n >= 14:
        m = n // 2
        vertex = _odd_cut_vertex(m + 1)
        return vertex - (vertex > _removed_for_doubling(m))
    return n - 1


# ------------------------------------------------------------------ dispatch


# (applies, builder, name): the first rule that applies builds the rings.
_CONSTRUCTIONS: tuple[tuple[Callable[[int], bool], Callable[[int], list[Ring]], str], ...] = (
    (_is_prime, _cyclic_rings, "prime n: ring g is x -> x + g"),
    (lambda n: n % 2 == 1, _rotational_rings, "odd n: Walecki's zigzag on Z_{n-1} plus infinity, both directions"),
    (lambda n: n % 4 == 0 and n >= 8, _rings_0mod4, "n % 4 == 0: cut and insert into the rings of K*_{n-1}"),
    (lambda n: n == 10, _rings_10, "n = 10: cut and insert (tabled cuts) into the rings of K*_9"),
    (lambda n: n % 4 == 2 and n >= 14, _rings_doubled, "n % 4 == 2: two-node doubling from K*_{n/2+1}"),
)

NO_DECOMPOSITION = (4, 6)


def construction_name(n: int) -> str:
    for applies, _, name in _CONSTRUCTIONS:
        if applies(n):
            return name
    return "exhaustive search for the largest arc-disjoint set (no decomposition exists)"


@lru_cache(maxsize=32)  # a doubling chain needs about log2(n) entries; a sweep must not keep n^3 arcs
def decompose(n: int) -> tuple[Ring, ...]:
    """n - 1 arc-disjoint directed Hamiltonian rings covering every arc of K*_n.

    Args:
        n: number of vertices, >= 2, not 4 or 6.
    Returns:
        The rings, verified by ``verify_decomposition``. Raises ``UsageError``
        for n < 2 and for n = 4, 6, where none exists.
    """
    _check_size(n)
    if n in NO_DECOMPOSITION:
        raise UsageError(_no_decomposition_message(n))
    for applies, build, _ in _CONSTRUCTIONS:
        if applies(n):
            rings = tuple(build(n))
            verify_decomposition(n, rings)
            return rings
    raise AssertionError(f"no construction covers n = {n}")  # the table covers every n >= 2 but 4 and 6


def hamiltonian_rings(n: int) -> RingSet:
    """Rings for n devices with all-to-all links: a full decomposition, or for n = 4, 6 the best set.

    Args:
        n: number of devices, >= 2.
    Returns:
        A ``RingSet``; for n = 4 and 6 its ``note`` says that no decomposition
        exists and ``cycles`` is a largest arc-disjoint set (exhaustive search
        over all directed Hamiltonian cycles: 6 of them for n = 4, 120 for n = 6).
    """
    _check_size(n)
    links = n * (n - 1)
    if n in NO_DECOMPOSITION:
        best = max_disjoint_rings(n)
        verify_decomposition(n, best, complete=False)
        return RingSet(n, best, links, construction_name(n), _no_decomposition_message(n, len(best)))
    return RingSet(n, decompose(n), links, construction_name(n))


# The rings list n(n-1) arcs; past this the output, not the construction, is the problem.
MAX_DEVICES = 1024


def _check_size(n: int) -> None:
    if not isinstance(n, int) or n < 2:
        raise UsageError(f"rings need at least 2 devices, got {n}")
    if n > MAX_DEVICES:
        raise UsageError(f"at most {MAX_DEVICES} devices are supported, got {n}")


def _no_decomposition_message(n: int, found: int | None = None) -> str:
    text = (
        f"K*_{n} has no decomposition into {n - 1} arc-disjoint directed Hamiltonian rings "
        f"(Tillson 1980: n = 4 and n = 6 are the only exceptions)"
    )
    if found is not None:
        unused = n * (n - 1) - found * n
        text += (
            f"; exhaustive search over all {factorial(n - 1)} directed Hamiltonian cycles finds at most "
            f"{found} arc-disjoint rings, leaving {unused} of {n * (n - 1)} arcs unused"
        )
    return text


@lru_cache(maxsize=None)
def max_disjoint_rings(n: int) -> tuple[Ring, ...]:
    """A largest set of arc-disjoint directed Hamiltonian cycles of K*_n, by exhaustive search.

    Every ring uses exactly one out-arc of vertex 0, so rings are grouped by that
    arc and at most one is taken per group: a branch-and-bound over (n-1)!
    cycles, meant for the tiny n where no decomposition exists.

    Args:
        n: 2 .. 7 (the search is exponential; larger n is refused).
    Returns:
        The first largest set found, rings starting at vertex 0.
    """
    if n > 7:
        raise ValueError("exhaustive search is only for n <= 7")
    index = {(a, b): a * n + b for a in range(n) for b in range(n)}
    groups: list[list[tuple[int, Ring]]] = [[] for _ in range(n - 1)]
    for rest in permutations(range(1, n)):
        ring = (0,) + rest
        mask = 0
        for arc in _arcs(ring):
            mask |= 1 << index[arc]
        groups[ring[1] - 1].append((mask, ring))
    best: list[Ring] = []

    def search(group: int, used: int, chosen: list[Ring]) -> None:
        nonlocal best
        if len(chosen) > len(best):
            best = list(chosen)
        if group == len(groups) or len(chosen) + len(groups) - group <= len(best):
            return
        for mask, ring in groups[group]:
            if not mask & used:
                chosen.append(ring)
                search(group + 1, used | mask, chosen)
                chosen.pop()
        search(group + 1, used, chosen)

    search(0, 0, [])
    return tuple(best)


# ------------------------------------------------------------------ multi-node


def path_decomposition(k: int) -> tuple[Ring, ...]:
    """k arc-disjoint directed Hamiltonian paths covering K*_k (each vertex starts and ends one).

    Args:
        k: >= 1, not 3 or 5 (no such decomposition exists there: K*_4, K*_6).
    Returns:
        The paths: for even k the zigzag paths i + z (Walecki's rings of
        K*_{k+1} without infinity); for odd k the rings of K*_{k+1} without
        the vertex that leaves a start -> end map of only odd cycles (what an
        odd number of nodes needs, see ``_odd_cut_vertex``).
    """
    if k == 1:
        return ((0,),)
    if k % 2 == 0:
        zig = _zigzag(k)
        return tuple(tuple((i + z) % k for z in zig) for i in range(k))
    return tuple(_paths_by_removing(decompose(k + 1), _odd_cut_vertex(k + 1)))


def rail_rings(nodes: int, per_node: int) -> RingSet:
    """K rings over M nodes of K devices with rail links: every intra-node arc used exactly once.

    M nodes of K devices, all-to-all inside a node, and device i of node a linked to device i of
    node b. Each device is its node's exit of exactly one ring. K exits per node and K rings mean
    each ring leaves (and so visits) every node exactly once: inside a node the K rings are K
    arc-disjoint Hamiltonian paths covering K*_K (``path_decomposition``), and a ring entering at
    device x leaves at omega_a(x) (the node's start -> end map). The rings close iff
    omega_{M-1} o ... o omega_0 is the identity. Nodes alternate a path decomposition and its
    reverse (omega, omega^-1); an odd M first uses three nodes whose maps compose to the identity
    (``_closing_triple``). An odd M needs an even map; for K % 4 == 2 the closed forms give odd
    ones, so tabled decompositions (K = 6 .. 42, every shape of up to 128 devices) are used.

    Args:
        nodes: M >= 1; per_node: K >= 1. Device i of node a is ``a * K + i``.
    Returns:
        A ``RingSet`` of K rings, verified by ``verify_rail_rings``. Raises
        ``UsageError`` with the reason when the shape admits no such rings
        (or, for odd M with K % 4 == 2 beyond the tables below, when no construction is known here).
    """
    M, K = nodes, per_node
    if not isinstance(M, int) or not isinstance(K, int) or M < 1 or K < 1:
        raise UsageError(f"a rail topology needs at least 1 node of at least 1 device, got {M} x {K}")
    if M * K > MAX_DEVICES:
        raise UsageError(f"at most {MAX_DEVICES} devices are supported, got {M} x {K} = {M * K}")
    for refuses, reason in _RAIL_REFUSALS:
        if refuses(M, K):
            raise UsageError(f"{M} node{'s' * (M != 1)} x {K} device{'s' * (K != 1)}: {reason(M, K)}")
    tabled = M % 2 == 1 and K % 4 == 2
    paths = _odd_cycle_path_decomposition(K) if tabled else path_decomposition(K)
    omega = _start_to_end(paths)
    node_paths = _node_paths(M, paths, omega)
    rings = []
    for first in range(K):
        ring, device = [], first
        for node in range(M):
            path = node_paths[node][device]
            ring += [node * K + v for v in path]
            device = path[-1]
        if device != first:
            raise ValueError(f"node maps do not compose to the identity ({first} -> {device})")
        rings.append(tuple(ring))
    verify_rail_rings(M, K, rings)
    links = M * K * (K - 1) + M * (M - 1) * K
    how = "one ring over the rails" if K == 1 else (
        f"every node a Hamiltonian path decomposition of K*_{K}{' (tabled, its map has only odd cycles)' * tabled}, "
        f"consecutive nodes' start -> end maps cancelling"
    )
    return RingSet(M * K, tuple(rings), links, how)


_BLOCKS = (
    "K exits per node and K rings mean every ring leaves every node exactly once, so inside a node "
    "the K rings are K arc-disjoint Hamiltonian paths that cover all K(K-1) intra-node arcs"
)

# (refuses(M, K), reason(M, K)): shapes refused, each with its reason; every rule but the
# last is a proof that no such rings exist, the last is a gap in the constructions here.
_RAIL_REFUSALS: tuple[tuple[Callable[[int, int], bool], Callable[[int, int], str]], ...] = (
    (
        lambda M, K: M == 1 and K > 1,
        lambda M, K: (
            f"no such rings exist: a single node has no rails, so a ring never leaves it and K = {K} rings of {K} arcs would need "
            f"{K * K} intra-node arcs, but the node has only {K * (K - 1)} (use `pipec rings {K}`)"
        ),
    ),
    (
        lambda M, K: M == 1 and K == 1,
        lambda M, K: "no such rings exist: one device has no links at all",
    ),
    (
        lambda M, K: K in (3, 5),
        lambda M, K: (
            f"no such rings exist: {_BLOCKS}; K*_{K} has no decomposition into {K} Hamiltonian paths (exhaustive search; adding a "
            f"vertex would turn one into a Hamiltonian decomposition of K*_{K + 1}, which does not exist)"
        ),
    ),
    (
        lambda M, K: K == 2 and M % 2 == 1,
        lambda M, K: (
            f"no such rings exist: {_BLOCKS}; with 2 devices a ring enters a node at one device and leaves at the other, so it "
            f"changes device index at every node and after an odd number ({M}) of nodes it cannot close"
        ),
    ),
    (
        lambda M, K: M % 2 == 1 and K % 4 == 2 and K > _LARGEST_TABLED,
        lambda M, K: (
            f"no construction is implemented for an odd number of nodes ({M}) with K % 4 == 2 and K > "
            f"{_LARGEST_TABLED} (K = {K}): the nodes' start -> end maps must compose to the identity, which needs a "
            f"path decomposition of K*_{K} with an even map; the closed forms here all map by a fixed-point-free "
            f"involution of K/2 (odd) transpositions, and the tabled ones stop at K = {_LARGEST_TABLED}; such rings "
            f"may exist (an even number of nodes always works)"
        ),
    ),
)


# --------------------------------------- odd node counts with K % 4 == 2: tables

# For an odd number of nodes the K start -> end maps must compose to the
# identity, so some map must be even. The closed-form paths of ``path_decomposition``
# map by translation by K/2, and for K % 4 == 2 that is K/2 transpositions, an
# odd permutation. These tables give path decompositions whose map has only odd
# cycles (what ``_closing_triple`` needs); they were found once, offline, by a
# depth-first search over the constraints stated below, and every ring built
# from them goes through ``verify_rail_rings`` like any other.

# K = 6: six paths found whole; their map 0 -> 4 -> 3 -> 0, 1 -> 2 -> 5 -> 1 is two 3-cycles.
_ODD_CYCLE_PATHS_6: tuple[Ring, ...] = (
    (0, 3, 1, 2, 5, 4), (1, 4, 3, 0, 5, 2), (2, 4, 0, 1, 3, 5),
    (3, 4, 2, 1, 5, 0), (4, 5, 1, 0, 2, 3), (5, 3, 2, 0, 4, 1),
)

# K = 2m, m odd >= 5: two base paths P and Q over two columns of Z_m (device
# c*m + x is x in column c). An arc (x, c) -> (y, d) has the class (c, d, y - x);
# P and Q together hold each of the 2K - 2 classes once, so their m translates
# each (x -> x + i inside a column) cover every arc of K*_K once. P starts and
# ends in column 0 and Q in column 1, so the map translates each column, and
# on Z_m with m odd a translation has only odd cycles.
_TWO_COLUMN_BASE_PATHS: dict[int, tuple[Ring, Ring]] = {
    10: ((0, 8, 7, 2, 3, 1, 6, 9, 5, 4),
         (5, 1, 3, 7, 9, 2, 8, 0, 4, 6)),
    14: ((0, 2, 3, 12, 1, 7, 13, 8, 6, 11, 9, 10, 5, 4),
         (7, 4, 8, 11, 3, 0, 5, 1, 9, 2, 12, 6, 13, 10)),
    18: ((0, 3, 5, 2, 16, 9, 13, 7, 8, 12, 1, 6, 17, 15, 14, 10, 11, 4),
         (9, 5, 12, 4, 3, 13, 10, 0, 17, 11, 8, 6, 15, 1, 16, 7, 2, 14)),
    22: ((0, 11, 15, 12, 1, 14, 13, 10, 3, 6, 5, 7, 19, 4, 9, 16, 21, 17, 18, 20, 2, 8),
         (11, 5, 21, 0, 7, 17, 4, 2, 3, 20, 1, 9, 12, 18, 6, 15, 13, 8, 16, 19, 10, 14)),
    26: ((0, 15, 18, 19, 3, 17, 25, 6, 10, 22, 24, 23, 12, 2, 1, 7, 5, 14, 4, 9, 20, 13, 11, 16, 21, 8),
         (13, 9, 19, 12, 15, 10, 7, 1, 20, 14, 5, 6, 8, 16, 4, 0, 17, 3, 11, 24, 21, 25, 23, 2, 22, 18)),
    30: ((0, 27, 3, 28, 22, 2, 4, 23, 29, 11, 14, 19, 20, 18, 21, 25, 17, 6, 7, 5, 12, 8, 26, 10, 1, 16, 15, 13, 24, 9),
         (15, 3, 17, 7, 6, 0, 5, 29, 26, 13, 2, 18, 12, 19, 24, 10, 23, 25, 20, 16, 9, 4, 27, 8, 1, 22, 14, 11, 28, 21)),
    34: ((0, 8, 28, 2, 17, 20, 6, 13, 18, 3, 21, 30, 10, 12, 15, 27, 22, 32, 19, 33, 29, 5, 31, 9, 23, 7, 11, 4, 16, 24, 14, 25, 26, 1),
         (17, 0, 5, 32, 23, 11, 28, 22, 24, 6, 25, 4, 10, 8, 21, 27, 14, 20, 19, 13, 7, 3, 12, 9, 30, 18, 16, 15, 31, 29, 1, 2, 26, 33)),
    38: ((0, 35, 33, 19, 25, 24, 21, 22, 6, 29, 12, 30, 37, 3, 17, 16, 10, 23, 5, 9, 7, 8, 32, 34, 2, 14, 20, 11, 28, 1, 31, 27, 15, 36, 26, 4, 13, 18),
         (19, 18, 2, 4, 32, 3, 30, 24, 17, 13, 10, 25, 28, 23, 35, 27, 16, 26, 7, 14, 5, 36, 15, 34, 11, 37, 12, 1, 21, 29, 33, 9, 31, 22, 8, 0, 6, 20)),
    42: ((0, 29, 11, 18, 41, 10, 1, 36, 28, 30, 8, 35, 6, 37, 14, 31, 17, 38, 22, 15, 24, 39, 13, 12, 32, 40, 25, 16, 27, 7, 33, 23, 4, 19, 20, 3, 9, 34, 2, 26, 21, 5),
         (21, 9, 11, 6, 40, 26, 2, 24, 38, 29, 12, 8, 18, 34, 19, 16, 4, 7, 0, 5, 13, 41, 23, 17, 15, 27, 28, 3, 22, 1, 14, 32, 36, 33, 20, 10, 25, 35, 31, 30, 39, 37)),
}

_LARGEST_TABLED = max(_TWO_COLUMN_BASE_PATHS)


def _odd_cycle_path_decomposition(k: int) -> tuple[Ring, ...]:
    """K*_k (k % 4 == 2, 6 <= k <= _LARGEST_TABLED) as k Hamiltonian paths whose start -> end map has only odd cycles."""
    if k == 6:
        return _ODD_CYCLE_PATHS_6
    m = k // 2
    return tuple(
        tuple(v - v % m + (v % m + i) % m for v in base)
        for base in _TWO_COLUMN_BASE_PATHS[k]
        for i in range(m)
    )


def _node_paths(M: int, paths: Sequence[Ring], omega: list[int]) -> list[dict[int, Ring]]:
    """Per node, start device -> path, chosen so that the maps compose to the identity."""
    reverse = [tuple(reversed(p)) for p in paths]
    if M % 2 == 0:
        chosen = [paths if node % 2 == 0 else reverse for node in range(M)]
    else:
        triple = _closing_triple(omega)
        if triple is None:
            raise UsageError(
                f"no construction is implemented for {M} nodes x {len(omega)} devices: with an odd number of "
                f"nodes the nodes' start -> end maps must compose to the identity, and the path decomposition "
                f"built here for K*_{len(omega)} has a map (cycle lengths {sorted(_cycle_lengths(omega))}) that "
                f"gives no such triple; such rings may exist (an even number of nodes always works)"
            )
        head = [_relabel(paths, _conjugator(omega, target)) for target in triple]
        chosen = head + [paths if node % 2 == 0 else reverse for node in range(M - 3)]
    return [{p[0]: p for p in decomposition} for decomposition in chosen]


def _closing_triple(omega: list[int]) -> tuple[list[int], list[int], list[int]] | None:
    """Three permutations of omega's cycle type whose composition (third o second o first) is the identity.

    Only odd cycles: omega, omega, omega^-2 (squaring keeps odd cycles' lengths).
    A fixed-point-free involution with an even number of 2-cycles: omega, beta,
    omega o beta, where beta swaps the 2-cycles of omega in pairs (a Klein group
    acting freely). Otherwise None.
    """
    lengths = _cycle_lengths(omega)
    if all(length % 2 for length in lengths):
        square = _compose(omega, omega)
        return omega, omega, _inverse(square)
    if all(length == 2 for length in lengths) and len(lengths) % 2 == 0:
        pairs = _cycles(omega)
        beta = list(range(len(omega)))
        for (a1, b1), (a2, b2) in zip(pairs[0::2], pairs[1::2]):
            beta[a1], beta[a2], beta[b1], beta[b2] = a2, a1, b2, b1
        return omega, beta, _compose(omega, beta)
    return None


def _start_to_end(paths: Sequence[Ring]) -> list[int]:
    omega = [0] * len(paths)
    for p in paths:
        omega[p[0]] = p[-1]
    return omega


def _relabel(paths: Sequence[Ring], theta: list[int]) -> list[Ring]:
    return [tuple(theta[v] for v in p) for p in paths]


def _conjugator(source: list[int], target: list[int]) -> list[int]:
    """theta with theta o source o theta^-1 == target (same cycle type): cycles matched by length."""
    theta = [0] * len(source)
    pool: dict[int, list[list[int]]] = {}
    for cycle in _cycles(target):
        pool.setdefault(len(cycle), []).append(cycle)
    for cycle in _cycles(source):
        for a, b in zip(cycle, pool[len(cycle)].pop()):
            theta[a] = b
    return theta


def _cycles(perm: list[int]) -> list[list[int]]:
    seen, out = [False] * len(perm), []
    for start in range(len(perm)):
        if not seen[start]:
            cycle, v = [], start
            while not seen[v]:
                seen[v] = True
                cycle.append(v)
                v = perm[v]
            out.append(cycle)
    return out


def _cycle_lengths(perm: list[int]) -> list[int]:
    return [len(c) for c in _cycles(perm)]


def _compose(outer: list[int], inner: list[int]) -> list[int]:
    return [outer[inner[v]] for v in range(len(inner))]


def _inverse(perm: list[int]) -> list[int]:
    out = [0] * len(perm)
    for v, image in enumerate(perm):
        out[image] = v
    return out
