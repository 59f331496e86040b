"""PipeDream's partitioner (compiler/partition.py): it equals a brute force over every contiguous cut and every
replication choice; an unbalanced model makes it isolate or replicate its slow layer; the partition file reads
back exactly and refuses what is wrong with a located message; the schedule it writes compiles, checks, and
simulates at the predicted time per microbatch."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from pipec.cli import main
from pipec.compiler.costs import CostModel, LayerCost, costs_from_json, roll_up, rolled_up
from pipec.compiler.partition import (
    WEIGHT_COPIES,
    in_flight,
    load_partition,
    partition,
    partition_from_json,
    partition_to_json,
)
from pipec.errors import CostFileError, UsageError


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# ------------------------------------------------------------------ brute force


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0,) + bars + (total,)
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


def every_partition(count: int, ranks: int, replicate: bool):
    """Every partition of ``count`` layers over ``ranks`` ranks: (stage bounds 0 .. count, replicas per stage)."""
    for stages in range(1, min(count, ranks) + 1):
        if not replicate and stages != ranks:
            continue
        for bars in itertools.combinations(range(1, count), stages - 1):
            for replicas in (compositions(ranks, stages) if replicate else [(1,) * stages]):
                yield (0,) + bars + (count,), replicas


def memories(layers, bounds, replicas) -> list:
    """Each stage's bytes per rank: weights and gradients, and the activations of the microbatches a replica
    keeps (1 at the end; before, one more than its share of those kept after it)."""
    keeps = [1] * len(replicas)
    for k in range(len(replicas) - 2, -1, -1):
        keeps[k] = 1 + math.ceil(replicas[k + 1] * keeps[k + 1] / replicas[k])
    return [WEIGHT_COPIES * sum(layer.parameters for layer in layers[first:stop])
            + keep * sum(layer.activation for layer in layers[first:stop])
            for first, stop, keep in zip(bounds, bounds[1:], keeps)]


def brute_force(layers, ranks, latency, bandwidth, ar_latency, ar_bandwidth, node_size, inter, limit, replicate):
    """Every partition, priced from docs/costs.md's formulas ("Partition it") written out again here; returns
    (time per microbatch, stage count, ((stop, replicas), ...)) of the best, or None when none fits."""

    def link_time(a: int, b: int, nbytes) -> float:
        lat, bw = (inter if node_size and a // node_size != b // node_size else (latency, bandwidth))
        return lat + (nbytes / bw if bw else 0)

    best = None
    for bounds, replicas in every_partition(len(layers), ranks, replicate):
        if limit is not None and max(memories(layers, bounds, replicas)) > limit:
            continue
        times, rank = [], 0
        for k, r in enumerate(replicas):
            span = layers[bounds[k]:bounds[k + 1]]
            compute = sum(layer.F + layer.B for layer in span) / r
            weights = sum(layer.parameters for layer in span)
            sync = 0 if r == 1 else 2 * (r - 1) * ar_latency + (2 * (r - 1) * weights / (r * ar_bandwidth)
                                                               if ar_bandwidth else 0)
            cut = 0
            if k < len(replicas) - 1:
                last = rank + r - 1
                cut = 2 * link_time(last, last + 1, span[-1].activation)
            times.append(max(compute, sync, cut))
            rank += r
        key = (max(times), len(replicas), tuple(zip(bounds[1:], replicas)))
        best = key if best is None or key < best else best
    return best


def every_peak_memory(layers, ranks, replicate) -> list:
    """Each partition's most bytes on a rank."""
    return [max(memories(layers, bounds, replicas)) for bounds, replicas in every_partition(len(layers), ranks,
                                                                                            replicate)]


def random_case(rng: random.Random):
    count = rng.randint(1, 10)
    ranks = rng.randint(1, 4)
    replicate = rng.random() < 0.5 or ranks > count
    layers = [LayerCost(f"l{i}", rng.randint(0, 9), rng.randint(1, 19), rng.randint(0, 50), rng.randint(0, 200))
              for i in range(count)]
    if rng.random() < 0.3:  # one slow layer
        slow = rng.randrange(count)
        layers[slow] = LayerCost(f"l{slow}", 30, 60, layers[slow].activation, layers[slow].parameters)
    links: dict = {}
    latency = bandwidth = 0
    inter = (0, 0)
    node_size = 0
    if rng.random() < 0.5:
        latency, bandwidth = rng.randint(0, 3), rng.choice([0, 4, 10, 25])
        links = {"latency": latency, **({"bandwidth": bandwidth} if bandwidth else {})}
        if rng.random() < 0.4:
            node_size = 2
            inter = (rng.randint(0, 5), rng.choice([2, 5]))
            links.update(node_size=2, inter_node={"latency": inter[0], "bandwidth": inter[1]})
    inter = inter if node_size else (latency, bandwidth)
    ar_latency = ar_bandwidth = 0
    data: dict = {"links": links} if links else {}
    if rng.random() < 0.5:
        ar_latency, ar_bandwidth = rng.randint(0, 2), rng.choice([10, 40, 100])
        data["allreduce"] = {"latency": ar_latency, "bandwidth": ar_bandwidth}
    return layers, ranks, replicate, costs_from_json(data), (latency, bandwidth, ar_latency, ar_bandwidth,
                                                              node_size, inter)


def test_the_partition_equals_a_brute_force_over_every_cut_and_replication():
    rng = random.Random(13)
    checked = limited = infeasible = 0
    for _ in range(300):
        layers, ranks, replicate, costs, priced = random_case(rng)
        limit = None
        if rng.random() < 0.5:  # a memory limit: sometimes one that fits nothing
            peaks = sorted(set(every_peak_memory(layers, ranks, replicate)))
            limit = rng.choice(peaks) if rng.random() < 0.8 else peaks[0] - 1
        expected = brute_force(layers, ranks, *priced, limit, replicate)
        if expected is None:
            with pytest.raises(UsageError, match=f"the smallest limit that fits is {min(every_peak_memory(layers, ranks, replicate))} bytes"):
                partition(layers, ranks, costs, memory_limit=limit, replicate=replicate)
            infeasible += 1
            continue
        found = partition(layers, ranks, costs, memory_limit=limit, replicate=replicate)
        time, stages, cuts = expected
        assert found.time_per_microbatch == time
        assert (len(found.stages), tuple((s.stop, s.replicas) for s in found.stages)) == (stages, cuts)
        assert found.time_per_microbatch == max(s.time for s in found.stages)
        if limit is not None:
            assert max(s.memory for s in found.stages) <= limit
            limited += 1
        checked += 1
    # the cases cover what they claim to
    assert checked > 200 and limited > 60 and infeasible > 5


def unbalanced_layers() -> list[dict]:
    """8 layers of F = 1, B = 2 and 100 parameter bytes, but layer 3: five times slower."""
    layers = [{"name": f"layer{i}", "F": 1, "B": 2, "activation": 10, "parameters": 100} for i in range(8)]
    layers[3].update(F=5, B=10)
    return layers


# the gradient all-reduce costs time (10 bytes a time unit), so replicating the whole model is not free
UNBALANCED = {"layers": unbalanced_layers(), "allreduce": {"bandwidth": 100}}


def test_an_unbalanced_model_isolates_its_slow_layer_or_replicates_it():
    costs = costs_from_json(UNBALANCED)
    alone = partition(costs.layers, 4, costs)
    assert [s.replicas for s in alone.stages] == [1, 1, 1, 1]
    assert any((s.first, s.stop) == (3, 4) for s in alone.stages)  # the slow layer is a stage of its own
    assert alone.time_per_microbatch == 15
    spread = partition(costs.layers, 4, costs, replicate=True)
    slow = next(s for s in spread.stages if s.first <= 3 < s.stop)
    assert slow.replicas > 1 and len(spread.stages) > 1  # replicated, and not plain data parallel
    assert spread.time_per_microbatch == 9 < alone.time_per_microbatch  # 36 units of work over 4 ranks


def test_in_flight_is_1f1b_without_replicas_and_covers_the_replicas_downstream():
    assert in_flight((1, 1, 1, 1)) == (4, 3, 2, 1)
    assert in_flight((1, 3)) == (4, 1)
    assert in_flight((1, 2, 1)) == (5, 2, 1)  # 2 replicas x 2 kept after stage 0, and one more
    assert in_flight((2, 1, 1)) == (2, 2, 1)  # each of 2 replicas: half of the 2 after it, and one more


def test_bad_problems_are_clear_errors():
    layers = [LayerCost(f"l{i}", 1, 2, 1, 1) for i in range(3)]
    with pytest.raises(UsageError, match="4 ranks need at least 4 layers without replication"):
        partition(layers, 4)
    assert len(partition(layers, 4, replicate=True).stages) >= 1
    with pytest.raises(UsageError, match="no layers"):
        partition([], 2)
    many = [LayerCost(f"l{i}", 1, 2, 1, 1) for i in range(4096)]
    with pytest.raises(UsageError, match="more than the"):  # refused before any work
        partition(many, 64, replicate=True)


def test_the_program_is_polynomial_on_a_larger_model():
    rng = random.Random(1)
    layers = [LayerCost(f"l{i}", rng.random(), rng.random(), rng.randint(1, 99), rng.randint(1, 999)) for i in range(48)]
    found = partition(layers, 8, costs_from_json({"allreduce": {"bandwidth": 1000}}), replicate=True,
                      memory_limit=10**6)
    assert sum(s.replicas for s in found.stages) == 8


# ------------------------------------------------------------------ the partition file


def test_the_partition_file_reads_back_exactly(tmp_path):
    costs = costs_from_json(UNBALANCED)
    for replicate in (False, True):
        part = partition(costs.layers, 4, costs, replicate=replicate)
        path = tmp_path / "part.json"
        path.write_text(json.dumps(partition_to_json(part)))
        assert load_partition(str(path)) == part


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(extra=1), "part.json: extra: unknown key"),
    (lambda d: d.pop("names"), "part.json: top level: missing names"),
    (lambda d: d.update(format="other"), "part.json: format: expected 'pipec partition'"),
    (lambda d: d.update(version=2), "part.json: version: this pipec reads version 1, got 2"),
    (lambda d: d["stages"][1].update(layers=[4, 8]), r"part.json: stages\[1\].layers: starts at layer 4, but the stage "
                                                     "before stops at layer 3"),
    (lambda d: d["stages"][1].update(replicas=2, ranks=[1, 2]), "part.json: stages: the stages' replicas add up to 3 "
                                                                "ranks, and the partition is for 4"),
    (lambda d: d["stages"][1].update(ranks=[2, 3, 1]), r"part.json: stages\[1\].ranks: expected the next 3 ranks, "
                                                       r"\[1, 2, 3\], got \[2, 3, 1\]"),
    (lambda d: d["stages"][1].update(ranks=[1, 2]), r"part.json: stages\[1\].ranks: expected one rank per replica, 3"),
    (lambda d: d["stages"][1].update(ranks=[1.0, 2, 3]), r"part.json: stages\[1\].ranks\[0\]: expected an integer"),
    (lambda d: d["stages"][1].update(ranks=[1, 2, 4]), r"part.json: stages\[1\].ranks\[2\]: expected an integer in "
                                                       r"0 .. 3, got 4"),
    (lambda d: d["stages"][0].update(replicas=0), r"part.json: stages\[0\].replicas: expected an integer in 1 .. 4"),
    (lambda d: d["stages"][0].update(time=-1), r"part.json: stages\[0\].time: expected a non-negative number"),
    (lambda d: d.update(stages=d["stages"][1:]), r"part.json: stages\[0\].layers: starts at layer 3, but the first "
                                                 "stage must start at layer 0"),
    (lambda d: d["stages"].pop(), r"part.json: stages\[0\].layers: the last stage stops at layer 3, but the model "
                                  "has 8 layers"),
    (lambda d: d.update(names=d["names"][:7]), "part.json: names: expected one name per layer, 8, got 7"),
    (lambda d: d["names"].__setitem__(2, "a\nb"), r"part.json: names\[2\]: expected a name"),
    (lambda d: d.update(time_per_microbatch=1), "part.json: time_per_microbatch: 1 is not the slowest stage's time"),
    (lambda d: d.update(stages=[]), "part.json: stages: expected at least one entry"),
])
def test_a_wrong_partition_file_is_a_located_error(change, message):
    costs = costs_from_json(UNBALANCED)
    data = partition_to_json(partition(costs.layers, 4, costs, replicate=True))
    change(data)
    with pytest.raises(UsageError, match=message):
        partition_from_json(data, "part.json")


def test_a_mutated_partition_file_loads_or_is_refused_never_a_traceback():
    costs = costs_from_json(UNBALANCED)
    original = partition_to_json(partition(costs.layers, 4, costs, replicate=True))
    rng = random.Random(3)
    values = [None, True, -1, 0, 1, 3, 8, 2.5, float(2**70), "", "x", "pipec partition", [], [0], [0, 3], [3, 8],
              [0, 1, 2], {}, {"layers": [0, 8]}]
    refused = 0
    for _ in range(400):
        data = json.loads(json.dumps(original))
        for _ in range(rng.randint(1, 3)):  # walk down to a random place and replace what is there
            holder, key = data, rng.choice(list(data))
            while isinstance(holder[key], (dict, list)) and holder[key] and rng.random() > 0.4:
                holder = holder[key]
                key = rng.choice(list(holder) if isinstance(holder, dict) else range(len(holder)))
            holder[key] = rng.choice(values)
        try:
            partition_from_json(data, "part.json")
        except UsageError as error:
            assert str(error).startswith("part.json")
            refused += 1
    assert refused > 300


# ------------------------------------------------------------------ per-layer costs


def test_layers_roll_up_into_chunks_and_a_cost_file_of_them():
    costs = costs_from_json(UNBALANCED)
    rolled = roll_up(costs.layers, [(0, 3), (3, 4), (4, 8)])
    assert rolled.per_chunk == ((3, 6), (5, 10), (4, 8)) and rolled.boundaries == (10, 10)
    chunked = costs_from_json(rolled_up(UNBALANCED, [(0, 3), (3, 8)]))
    assert (chunked.compute("F", 1), chunked.compute("B", 1), chunked.compute("W", 1)) == (9, 18, 9)
    assert chunked.layers == () and chunked.allreduce_link == costs.allreduce_link
    with pytest.raises(UsageError, match="chunk 1 holds layers 4..8"):
        roll_up(costs.layers, [(0, 3), (4, 8)])
    with pytest.raises(UsageError, match="the chunks hold layers 0..7, and the model has 8"):
        roll_up(costs.layers, [(0, 7)])


@pytest.mark.parametrize("layers, message", [
    ([], "c.json: layers: expected at least one entry"),
    ({"name": "a"}, "c.json: layers: expected an array"),
    ([{"name": "a", "F": 1, "B": 2, "activation": 3}], r"c.json: layers\[0\]: missing parameters"),
    ([{"name": "a", "F": 1, "B": 2, "activation": 3, "parameters": 4, "W": 1}], r"c.json: layers\[0\].W: unknown key"),
    ([{"name": "a", "F": 1, "B": -2, "activation": 3, "parameters": 4}], r"c.json: layers\[0\].B: expected a non-negative"),
    ([{"name": "", "F": 1, "B": 2, "activation": 3, "parameters": 4}], r"c.json: layers\[0\].name: expected a name"),
    ([{"name": "a", "F": 1, "B": 2, "activation": 3, "parameters": 4}] * 2, r"c.json: layers\[1\].name: 'a' names layer 0"),
])
def test_a_wrong_layers_key_is_a_located_error(layers, message):
    with pytest.raises(CostFileError, match=message):
        costs_from_json({"layers": layers}, "c.json")


# ------------------------------------------------------------------ the command and its schedule


def makespan(capsys, schedule, costs, microbatches: int):
    status, out, err = run(capsys, "simulate", schedule, "-D", f"N={microbatches}", "--costs", costs, "--json")
    assert status == 0, err
    return json.loads(out)["makespan"]


@pytest.mark.parametrize("replicate", [False, True])
def test_the_schedule_it_writes_checks_and_simulates_at_the_predicted_time(capsys, tmp_path, replicate):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(UNBALANCED))
    schedule, chunks, part_file = tmp_path / "part.pipe", tmp_path / "chunks.json", tmp_path / "part.json"
    status, out, err = run(capsys, "partition", "--costs", str(costs), "-D", "P=4", *(["--replicate"] * replicate),
                           "-o", str(part_file), "--schedule-out", str(schedule), "--costs-out", str(chunks))
    assert status == 0, err
    part = load_partition(str(part_file))
    assert f"predicted time per microbatch {part.time_per_microbatch}" in out.splitlines()[0]
    assert "layer3" in out and len(out.splitlines()) == 2 + len(part.stages)
    status, out, err = run(capsys, "check", str(schedule))
    assert status == 0 and out.startswith("ok: partitioned"), err
    # the steady state: the makespan grows by the slowest stage's time with every microbatch (whole rounds of
    # the K pipelines, past the start-up)
    rounds = math.lcm(*part.replicas)
    first, second = 12 * rounds, 20 * rounds
    grown = makespan(capsys, str(schedule), str(chunks), second) - makespan(capsys, str(schedule), str(chunks), first)
    assert grown / (second - first) == part.time_per_microbatch


def test_the_command_prints_json_and_refuses_bad_input(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(UNBALANCED))
    status, out, _ = run(capsys, "partition", "--costs", str(costs), "-D", "P=2", "--json")
    assert status == 0 and partition_from_json(json.loads(out)).ranks == 2
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"compute": {"F": 1}}))
    for argv, message in [
        (["--costs", str(costs)], "needs the ranks to partition over: -D P=RANKS"),
        (["--costs", str(costs), "-D", "N=2"], "-D N: pipec partition takes one parameter, P"),
        (["--costs", str(costs), "-D", "P=9"], "9 ranks need at least 9 layers"),
        (["--costs", str(costs), "-D", "P=4", "--memory", "100"], "the smallest limit that fits is 480 bytes"),
        (["--costs", str(bare), "-D", "P=2"], 'no "layers" to partition'),
        (["--costs", str(tmp_path / "missing.json"), "-D", "P=2"], "no such file"),
    ]:
        status, out, err = run(capsys, "partition", *argv)
        assert status == 1 and out == "" and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unit_costs_make_communication_free():
    layers = costs_from_json(UNBALANCED).layers
    assert partition(layers, 4) == partition(layers, 4, CostModel.unit())


def test_no_output_is_replaced_when_a_later_one_cannot_be_written(capsys, tmp_path):
    """Every output is checked writable before any is written (was: ``-o`` replaced, then ``--schedule-out`` into a
    missing folder failed, leaving the user's old partition file gone)."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(UNBALANCED))
    old = tmp_path / "part.json"
    old.write_text("the user's old partition file\n")
    status, out, err = run(capsys, "partition", "--costs", str(costs), "-D", "P=2", "-o", str(old),
                           "--schedule-out", str(tmp_path / "missing" / "part.pipe"))
    assert status == 1 and "cannot write the schedule (--schedule-out)" in err and "does not exist" in err, err
    assert old.read_text() == "the user's old partition file\n"
