"""benchmarks/bitpipe_8gpu.py: its cost files, its FLOP formula, the eager all-reduce it relies on, and a run on a
reduced grid (a few seconds)."""
from __future__ import annotations

import pytest

from pipec.compiler.costs import costs_from_json, load_costs
from pipec.compiler.driver import compile_target
from pipec.compiler.ops import ALLREDUCE_GRAD
from pipec.compiler.simulate import simulate
from benchmark_util import load_benchmark

bench = load_benchmark("bitpipe_8gpu")
HARDWARE = bench.Hardware(tflops=100, link_gbs=200, link_latency_us=10, allreduce_gbs=200, allreduce_latency_us=10)


def test_bert_chunk_of_four_layers_is_priced_by_the_flop_formula():
    bert = bench.MODELS["bert"]
    # 24 b s h^2 + 4 b s^2 h with b = 4, s = 512, h = 2560, written out
    assert bert.layer_forward_flops() == 24 * 4 * 512 * 2560 ** 2 + 4 * 4 * 512 ** 2 * 2560 == 332_859_965_440
    costs = costs_from_json(bench.chunk_costs(bert, 4, HARDWARE))
    forward = 4 * 332_859_965_440 / 100e12  # 13.31 ms
    assert costs.compute("F", 0) == pytest.approx(forward, rel=1e-12)
    assert costs.compute("B", 5) == pytest.approx(2 * forward, rel=1e-12)
    activation = 4 * 512 * 2560 * 2  # b s h fp16
    assert costs.message_bytes_of("act") == costs.message_bytes_of("grad") == activation
    assert costs.transfer(0, 1, "act") == pytest.approx(10e-6 + activation / 200e9, rel=1e-12)
    weights = 4 * 12 * 2560 ** 2 * 2  # 4 layers of 12 h^2 fp16 parameters
    assert costs.allreduce(2, 0) == pytest.approx(2 * 10e-6 + weights / 200e9, rel=1e-12)


def test_chunk_sizes_follow_the_compiled_schedules():
    gpt = bench.MODELS["gpt"]
    layers = {schedule.name: bench.chunk_layers(gpt, schedule, 8) for schedule in bench.SCHEDULES}
    assert layers == {"bitpipe": 6, "1f1b": 12, "interleaved_1f1b": 6, "chimera": 12}


def test_written_cost_files_are_valid(tmp_path, capsys):
    assert bench.main(["--models", "bert", "--microbatches", "8", "--no-search", "--costs-out", str(tmp_path)]) == 0
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == ["bert_4layers.json", "bert_8layers.json"]
    costs = load_costs(str(tmp_path / "bert_8layers.json"))  # the guarded reader, every key checked
    assert costs.compute("F", 0) == pytest.approx(8 * 332_859_965_440 / 100e12, rel=1e-12)


def test_replicas_all_reduce_starts_at_the_chunks_last_backward_and_overlaps_compute():
    """What the benchmark relies on for BitPipe's eager gradient synchronisation."""
    costs = costs_from_json(bench.chunk_costs(bench.MODELS["bert"], 4, HARDWARE))
    program = compile_target("bitpipe", {"P": 8, "N": 8}, costs=costs).program
    result = simulate(program, costs)
    chunk_of = [stage.chunk for stage in program.stages]
    last_backward: dict[int, float] = {}
    starts: dict[int, set] = {}
    for lane in result.timeline:
        for slot in lane:
            chunk = chunk_of[slot.action.stage]
            if slot.is_comm and slot.action.op == ALLREDUCE_GRAD:
                starts.setdefault(chunk, set()).add(slot.start)
            elif not slot.is_comm and slot.action.op == "B":
                last_backward[chunk] = max(last_backward.get(chunk, 0), slot.end)
    assert set(starts) == set(range(program.num_chunks))
    for chunk, start in starts.items():
        assert start == {last_backward[chunk]}  # both replicas done, and not a moment later
    assert min(min(s) for s in starts.values()) < result.makespan - 2 * costs.allreduce(2, 0)  # overlapped


def test_main_prints_the_speedups_beside_the_papers(capsys):
    assert bench.main(["--models", "bert", "--microbatches", "8", "--link-grid", "200",
                       "--allreduce-grid", "10,200"]) == 0
    out = capsys.readouterr().out
    for label, paper in (("DAPPLE", "1.27"), ("1F1B-Int", "1.12"), ("Chimera", "1.09")):
        assert f"speed-up of BitPipe over {label}: " in out and f"(paper {paper}x" in out
    assert "Search, BERT-64" in out and "all three within 10% at once" in out


@pytest.mark.parametrize("argv, message", [
    (["--microbatches", "12"], "multiple of D = 8"),
    (["--models", "llama"], "unknown model"),
    (["--tflops", "-5"], "--tflops"),
    (["--link-grid", "10,,20"], "comma-separated list"),
    (["--costs-out", "/nonexistent/folder"], "no such folder"),
])
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
