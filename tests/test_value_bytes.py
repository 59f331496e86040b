"""Memory in bytes per value class, as a user reaches it: the cost file's "sizes", the byte budget of
check_all / compile_target, and `pipec simulate` / `pipec check` with `--costs` and `--budget-bytes`."""
from __future__ import annotations

import json
import re

import pytest

from pipec.cli import main
from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.costs import CostModel, costs_from_json, load_costs
from pipec.compiler.driver import compile_target
from pipec.compiler.memory_counts import peak_bytes
from pipec.errors import BudgetError, CostFileError, UsageError

ACT = 4 * 1024 * 1024  # 4 MiB per activation-sized value
WEIGHT = 1.2e8


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def cost_file(tmp_path, data) -> str:
    path = tmp_path / "costs.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.fixture
def sized(tmp_path) -> str:
    return cost_file(tmp_path, {"sizes": {"activation": ACT, "weight": WEIGHT}})


# ----------------------------------------------------------------- the cost file's section


def test_sizes_section_round_trips(tmp_path):
    costs = load_costs(cost_file(tmp_path, {"sizes": {"weight": WEIGHT, "activation": ACT, "kv": 0}}))
    assert costs.value_bytes == (("activation", ACT), ("kv", 0), ("weight", WEIGHT))  # sorted, hashable
    assert costs.sizes == {"activation": ACT, "weight": WEIGHT, "kv": 0}
    assert list(costs.sizes) == [c for c in ops.SIZE_CLASSES if c in costs.sizes]  # in the table's order
    assert type(costs.sizes["activation"]) is int
    again = costs_from_json({"sizes": {"activation": ACT, "kv": 0, "weight": WEIGHT}})
    assert costs == again and hash(costs) == hash(again)
    assert costs != CostModel.unit()
    # sizes price no time: the rest of the model is the unit one
    assert costs.compute("B", 0) == 2 and costs.transfer(0, 1, "act") == 0


def test_no_sizes_is_an_empty_table(tmp_path):
    assert CostModel.unit().sizes == {} and CostModel.unit().value_bytes == ()
    assert load_costs(cost_file(tmp_path, {"compute": {"F": 2}})).sizes == {}
    assert costs_from_json({"sizes": {}}) == CostModel.unit()


BAD_SIZES = [
    ('{"sizes": {"activations": 1}}', "sizes.activations"),
    ('{"sizes": {"act": 1}}', "sizes.act"),
    ('{"sizes": {"activation": -1}}', "sizes.activation"),
    ('{"sizes": {"weight": "8"}}', "sizes.weight"),
    ('{"sizes": {"kv": true}}', "sizes.kv"),
    ('{"sizes": {"stats": null}}', "sizes.stats"),
    ('{"sizes": {"shard": Infinity}}', "sizes.shard"),
    ('{"sizes": {"activation": NaN}}', "sizes.activation"),
    ('{"sizes": [1]}', "sizes"),
    ('{"sizes": 4}', "sizes"),
]


@pytest.mark.parametrize("content,key", BAD_SIZES)
def test_bad_sizes_name_the_file_and_the_key(tmp_path, content, key):
    path = cost_file(tmp_path, content)
    with pytest.raises(CostFileError) as caught:
        load_costs(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {key}:")


def test_unknown_size_class_lists_the_known_ones(tmp_path):
    with pytest.raises(CostFileError, match="expected one of activation, weight, shard, kv, stats"):
        load_costs(cost_file(tmp_path, {"sizes": {"activations": 1}}))


# ----------------------------------------------------------------- the library: check_all, compile_target


def test_check_all_and_compile_target_take_a_byte_budget():
    costs = costs_from_json({"sizes": {"activation": ACT}})
    program = compile_target("1f1b", {"P": "4", "N": "8"}, costs=costs, byte_budget={"activation": 4 * ACT}).program
    check_all(program, byte_budget={"activation": 4 * ACT}, sizes=costs.sizes)
    with pytest.raises(BudgetError):
        check_all(program, byte_budget={"activation": 4 * ACT - 1}, sizes=costs.sizes)
    with pytest.raises(BudgetError):
        compile_target("1f1b", {"P": "4", "N": "8"}, costs=costs, byte_budget={"activation": 4 * ACT - 1})
    with pytest.raises(UsageError, match="'weight'"):  # no size for the class: refused before compiling
        compile_target("1f1b", {"P": "4", "N": "8"}, costs=costs, byte_budget={"weight": 1})
    with pytest.raises(UsageError, match="'activation'"):
        compile_target("1f1b", {"P": "4", "N": "8"}, byte_budget={"activation": 1})


# ----------------------------------------------------------------- pipec simulate


PEAK_BYTES = re.compile(r"^  rank (\d+): .*, peak bytes (.*)$")


def test_simulate_prints_peak_bytes_of_size_times_counts(capsys, sized):
    program = compile_target("zb_h1", {"P": "4", "N": "8"}).program
    expected = peak_bytes(program, {"activation": ACT, "weight": WEIGHT})
    status, out, err = run(capsys, "simulate", "zb_h1", "-D", "P=4", "-D", "N=8", "--costs", sized)
    assert status == 0 and err == ""
    rows = [PEAK_BYTES.match(line) for line in out.splitlines()[1:]]
    assert all(rows) and [int(m.group(1)) for m in rows] == [0, 1, 2, 3]
    # activation-sized: saved activations plus what an I leaves for its W, alive together
    for rank, m in enumerate(rows):
        assert expected[rank]["activation"] % ACT == 0
        mib = expected[rank]["activation"] // (1024 * 1024)
        assert m.group(2) == f"activation {mib} MiB, weight 0 B"
    # zb_h1 on 4 ranks: a rank's saved activations and waiting weight gradients add up to 4 at the peak
    assert [rank["activation"] for rank in expected] == [4 * ACT] * 4

    status, out, _ = run(capsys, "simulate", "zb_h1", "-D", "P=4", "-D", "N=8", "--costs", sized, "--json")
    assert status == 0
    data = json.loads(out)
    assert [rank["peak_bytes"] for rank in data["ranks"]] == expected  # exact bytes
    assert all(list(rank["peak_bytes"]) == ["activation", "weight"] for rank in data["ranks"])


def test_simulate_without_sizes_prints_no_bytes(capsys, tmp_path):
    plain = run(capsys, "simulate", "zb_h1", "-D", "P=4", "-D", "N=8")
    assert "bytes" not in plain[1]
    with_file = run(capsys, "simulate", "zb_h1", "-D", "P=4", "-D", "N=8", "--costs", cost_file(tmp_path, {}))
    assert with_file == plain
    status, out, _ = run(capsys, "simulate", "zb_h1", "-D", "P=4", "-D", "N=8", "--json")
    assert status == 0 and all("peak_bytes" not in rank for rank in json.loads(out)["ranks"])


# ----------------------------------------------------------------- pipec check --budget-bytes


def test_check_prints_peak_bytes_per_class(capsys, sized):
    status, out, err = run(capsys, "check", "1f1b", "-D", "P=4", "-D", "N=8", "--costs", sized)
    assert status == 0 and err == "" and out.count("\n") == 1
    assert out.rstrip().endswith(
        "peak activations per rank [4, 3, 2, 1]; peak bytes per rank activation [16 MiB, 12 MiB, 8 MiB, 4 MiB], "
        "weight [0 B, 0 B, 0 B, 0 B]")


def test_byte_budget_passes_at_the_peak_and_fails_one_byte_below(capsys, sized):
    program = compile_target("1f1b", {"P": "4", "N": "8"}).program
    peak = max(rank["activation"] for rank in peak_bytes(program, {"activation": ACT}))
    assert peak == 4 * ACT
    args = ("check", "1f1b", "-D", "P=4", "-D", "N=8", "--costs", sized)
    status, out, err = run(capsys, *args, "--budget-bytes", f"activation={peak}")
    assert status == 0 and out.startswith("ok: ") and err == ""
    status, out, err = run(capsys, *args, "--budget-bytes", f"activation={peak}.0", "--budget-bytes", "weight=0")
    assert status == 0 and err == ""

    status, out, err = run(capsys, *args, "--budget-bytes", f"activation={peak - 1}")
    assert status == 1 and out == "" and "Traceback" not in err
    head = err.splitlines()[0]
    assert re.match(r"rank 0, step \d+: ", head), head
    assert f"over the activation budget of {peak - 1} bytes" in head and f"peak is {peak} bytes" in head


def test_byte_budget_needs_the_size_of_its_class(capsys, tmp_path, sized):
    message = ('a byte budget for \'activation\' needs its size: add "sizes": {"activation": BYTES} '
               "to the cost file (--costs)\n")
    status, out, err = run(capsys, "check", "1f1b", "-D", "P=4", "-D", "N=8", "--budget-bytes", "activation=100")
    assert (status, out, err) == (1, "", message)
    only_compute = cost_file(tmp_path, {"compute": {"F": 1}})
    status, _, err = run(capsys, "check", "1f1b", "--costs", only_compute, "--budget-bytes", "activation=100")
    assert (status, err) == (1, message)
    status, _, err = run(capsys, "simulate", "1f1b", "--costs", sized, "--budget-bytes", "kv=1")
    assert status == 1 and err.startswith("a byte budget for 'kv' needs its size: add \"sizes\": {\"kv\": BYTES}")


@pytest.mark.parametrize("value,words", [
    ("activations=1", "unknown size class 'activations'"),
    ("activation=-1", "non-negative integer or decimal"),
    ("activation=1e6", "non-negative integer or decimal"),
    ("activation=lots", "non-negative integer or decimal"),
    ("activation=", "non-negative integer or decimal"),
    ("activation", "expects CLASS=BYTES"),
])
def test_bad_budget_bytes_is_a_usage_error(capsys, sized, value, words):
    status, out, err = run(capsys, "check", "1f1b", "--costs", sized, "--budget-bytes", value)
    assert status == 1 and out == "" and words in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_a_class_given_twice_is_a_usage_error(capsys, sized):
    status, _, err = run(capsys, "check", "1f1b", "--costs", sized,
                         "--budget-bytes", "activation=1", "--budget-bytes", "activation=2")
    assert status == 1 and "'activation' twice" in err


def test_human_bytes():
    from pipec.commands._common import human_bytes

    assert [human_bytes(n) for n in (0, 0.0, 2.5, 1023, 1024, 1536, 16 * 2**20, 1.2e8, 2**20 - 1)] == [
        "0 B", "0 B", "2.5 B", "1023 B", "1 KiB", "1.5 KiB", "16 MiB", "114.4 MiB", "1 MiB"]
