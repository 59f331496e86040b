"""A model given by its layers: pipec cuts it, evenly or by a partition file, and it trains like one process.

``tests/layered_model.py`` is a user's spec with ``layers(config, seed)`` (a
12-layer ``nn.Sequential`` of Linear + Tanh blocks) and no ``build_chunk``.
One set of 4 gloo processes (``launch_batch``) trains it for 3 steps under
1f1b (even cut), interleaved 1F1B with v = 3 (12 chunks of one layer), 1f1b
cut by an uneven partition file (1, 2, 4, 5 layers), and a program with a
replicated stage (stage 0 on ranks 0 and 1, microbatch m on pipeline m % 2)
cut by a matching partition; then resumes the interleaved run's checkpoint
under the uneven cut for 2 more steps. Every saved model must equal the
one-process run. The errors (more chunks than layers, a partition of another
stage count, layer count or placement, a partition for a spec that builds its
own chunks, malformed partition files) are checked without starting a worker.
"""
from __future__ import annotations

import functools
import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import layered_model
from pipec.cli import build_parser, main
from pipec.commands import run as run_command
from pipec.compiler.driver import compile_target
from pipec.compiler.partition import load_partition
from pipec.errors import UsageError
from pipec.runtime.layered import LayeredChunks, build_layers, cut_by_partition, even_cut
from pipec.runtime.model import LLAMA, ModelSpec, load_model_spec
from pipec.runtime.reference import reference_run
from pipec.runtime.worker import build_parser as worker_parser
from runtime_util import TOLERANCE, assert_same_parameters, launch_batch

TESTS = str(Path(__file__).resolve().parent)
MODEL = "layered_model:SPEC"
SPEC, CONFIG = layered_model.SPEC, layered_model.Config()
STEPS, SEED, N = 3, 11, 4
BATCH_DEADLINE_S = 180.0
# Stage 0 replicated on ranks 0 and 1 (one replica per pipeline, microbatch m on pipeline m % 2); stages 1
# and 2 on ranks 2 and 3, shared by both pipelines.
REPLICATED = """
schedule replicated(P: ranks = 4, N: microbatches = 4) {
  require P == 4 : "this placement is written for 4 ranks"
  require N % 2 == 0 : "the microbatches alternate between the two pipelines"
  stages 3
  pipelines 2
  route microbatch m to pipeline m % 2
  place stage s of pipeline p on rank s == 0 ? p : s + 1
  order greedy { inflight on rank r <= 4 }
}
"""


def partition(cut, ranks, num_ranks=4, layers=12) -> dict:
    """A partition file's content: per stage its (first, stop) and its ranks."""
    return {
        "format": "pipec partition", "version": 1, "layers": layers, "ranks": num_ranks,
        "names": [f"layer{i}" for i in range(layers)],
        "stages": [{"layers": list(bounds), "replicas": len(on), "ranks": list(on), "time": 1.0, "memory": 0}
                   for bounds, on in zip(cut, ranks)],
        "time_per_microbatch": 1.0,
    }


# A cost file whose best partition over 4 ranks replicates: layers 0..5 are slow with few weights, layers
# 6..11 fast with weights too heavy to all-reduce, so PipeDream's program puts 0..5 on 3 replicas (18 / 3 = 6
# per microbatch) and 6..11 on one rank (4.5).
PROFILED = {
    "layers": [{"name": f"layer{i}", "F": 1 if i < 6 else 0.25, "B": 2 if i < 6 else 0.5, "activation": 64,
                "parameters": 8 if i < 6 else 1_000_000} for i in range(12)],
    "allreduce": {"bandwidth": 1000},
}

UNEVEN = partition([(0, 1), (1, 3), (3, 7), (7, 12)], [[0], [1], [2], [3]])
REPLICAS = partition([(0, 6), (6, 9), (9, 12)], [[0, 1], [2], [3]])


def write(folder: Path, name: str, content) -> str:
    path = folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


# ------------------------------------------------------------------ the cut, one process


def test_the_whole_model_is_the_users_sequential_seeded_with_the_seed_and_leaves_the_callers_rng_alone():
    state = torch.get_rng_state()
    whole = SPEC.build_model(CONFIG, SEED)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(SEED)
    mine = layered_model.layers(CONFIG, SEED)
    assert list(whole.state_dict()) == list(mine.state_dict())  # "3.0.weight": nn.Sequential's names
    assert all(torch.equal(whole.state_dict()[k], mine.state_dict()[k]) for k in mine.state_dict())
    x = torch.randn(2, CONFIG.width)
    assert torch.equal(whole(x), mine(x))


@pytest.mark.parametrize("cut", [None, ((0, 1), (1, 3), (3, 7), (7, 12))], ids=["even", "partition"])
def test_chunks_merge_into_the_whole_model_and_compose_to_its_forward(cut):
    chunks_of = LayeredChunks(layered_model.layers, cut, "partition p.json")
    chunks = [chunks_of(CONFIG, c, 4, SEED) for c in range(4)]
    whole = SPEC.build_model(CONFIG, SEED).state_dict()
    merged = {k: v for chunk in chunks for k, v in chunk.state_dict().items()}
    assert list(merged) == list(whole) and all(torch.equal(merged[k], whole[k]) for k in whole)
    sizes = [len(chunk) for chunk in chunks]
    assert sizes == ([3, 3, 3, 3] if cut is None else [1, 2, 4, 5])
    x = torch.randn(3, CONFIG.width)
    y = x
    for chunk in chunks:
        y = chunk(y)
    assert torch.equal(y, SPEC.build_model(CONFIG, SEED)(x))


def test_an_even_cut_gives_the_first_chunks_the_extra_layers():
    assert even_cut(12, 5) == ((0, 3), (3, 6), (6, 8), (8, 10), (10, 12))
    assert even_cut(3, 3) == ((0, 1), (1, 2), (2, 3))
    with pytest.raises(UsageError, match="12 layers cannot be cut into the program's 13 chunks"):
        even_cut(12, 13)


def test_named_layers_keep_their_names_and_tuples_pass_between_layers():
    class Pair(nn.Module):
        def forward(self, x):
            return x * 2, x + 1

    class Join(nn.Module):
        def forward(self, pair):
            return pair[0] - pair[1]

    spec = ModelSpec(layers=lambda config, seed: nn.Sequential(OrderedDict(
        [("embed", nn.Linear(2, 2)), ("split", Pair()), ("join", Join()), ("head", nn.Linear(2, 1))])),
        microbatch=layered_model.microbatch, loss_fn=nn.functional.mse_loss, make_optimizer=torch.optim.SGD)
    assert list(spec.build_model(None, 0).state_dict()) == ["embed.weight", "embed.bias", "head.weight", "head.bias"]
    first, second = spec.build_chunk(None, 0, 2, 0), spec.build_chunk(None, 1, 2, 0)
    x = torch.randn(3, 2)
    assert torch.equal(second(*first(x)), spec.build_model(None, 0)(x))  # the tuple crosses as a payload


@pytest.mark.parametrize("made, words", [
    (lambda config, seed: nn.Linear(2, 2), "returned a Linear, not an nn.Sequential"),
    (lambda config, seed: [], "returned no layers"),
    (lambda config, seed: [nn.Linear(2, 2), "relu"], "layer 1 is a str, not an nn.Module"),
    (lambda config, seed: [shared := nn.Linear(2, 2), nn.Tanh(), shared], "layers 0 and 2 share a parameter"),
    (lambda config, seed: 1 / 0, "layers(config, seed) failed: ZeroDivisionError"),
])
def test_layers_that_cannot_be_cut_are_named(made, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_layers(made, None, 0)


def test_a_reused_parameterless_layer_is_fine():
    tanh = nn.Tanh()
    named = build_layers(lambda config, seed: [nn.Linear(2, 2), tanh, nn.Linear(2, 2), tanh], None, 0)
    assert [name for name, _ in named] == ["0", "1", "2", "3"]


# ------------------------------------------------------------------ the spec interface


def test_a_spec_gives_its_builders_or_its_layers_and_says_which_it_lacks():
    common = dict(microbatch=layered_model.microbatch, loss_fn=nn.functional.mse_loss, make_optimizer=torch.optim.SGD)
    assert SPEC.derives_chunks and not LLAMA.derives_chunks
    assert SPEC.summary() == "model from layered_model"
    with pytest.raises(UsageError, match=r"missing or not callable: build_chunk and build_model \(or layers\)"):
        ModelSpec(**common)
    with pytest.raises(UsageError, match=r"missing or not callable: build_model \(a spec gives build_chunk and "
                                         r"build_model together, or neither and layers\)"):
        ModelSpec(build_chunk=LLAMA.build_chunk, layers=layered_model.layers, **common)
    with pytest.raises(UsageError, match="the model spec's layers is a int, not a function"):
        ModelSpec(layers=3, **common)
    # all three: its own build_chunk runs the model; layers stays for the profiler
    both = ModelSpec(build_chunk=LLAMA.build_chunk, build_model=LLAMA.build_model, layers=layered_model.layers,
                     **common)
    assert both.build_chunk is LLAMA.build_chunk and not both.derives_chunks


def test_a_module_with_layers_and_no_build_chunk_is_a_spec(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pipec_test_layers_module.py").write_text(
        "from layered_model import Config, layers, microbatch\n"
        "from torch.nn.functional import mse_loss as loss_fn\n"
        "from torch.optim import SGD as make_optimizer\n"
        "config = Config()\n")
    spec = load_model_spec("pipec_test_layers_module")
    assert spec.derives_chunks and spec.layers is layered_model.layers
    assert list(spec.build_model(spec.config, 0).state_dict()) == list(SPEC.build_model(CONFIG, 0).state_dict())


def test_the_ranks_compare_the_cut_a_partition_gives(tmp_path):
    """Nodes started with partitions of other cuts would train other chunks: the agreement check names the cut."""
    from pipec.runtime.agreement import what_runs
    from pipec.runtime.worker import make_plan, parse_run_config

    def cut_of(*extra):
        config = parse_run_config(["1f1b", "-D", "P=4", "-D", "N=4", "--model", MODEL, *extra])
        return what_runs(make_plan(config, 4))["--partition"]

    assert cut_of() == "not given"
    assert cut_of("--partition", write(tmp_path, "p.json", UNEVEN)) == "layers 0-1, 1-3, 3-7, 7-12"


def test_the_launcher_passes_the_partition_to_the_workers_as_an_absolute_path():
    passed = run_command.worker_arguments(build_parser().parse_args(["run", "1f1b", "--partition", "p.json"]))
    assert worker_parser().parse_args(passed).partition == str(Path("p.json").resolve())


# ------------------------------------------------------------------ errors before any worker starts


def _run(argv: list[str], capsys) -> str:
    status = main(["run", *argv, "--model", MODEL])
    _, err = capsys.readouterr()
    assert status == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_more_chunks_than_layers_is_refused_naming_both(capsys, no_launch):
    err = _run(["interleaved_1f1b", "-D", "P=4", "-D", "v=4", "-D", "N=4"], capsys)
    assert "12 layers cannot be cut into the program's 16 chunks" in err


@pytest.mark.parametrize("content, words", [
    (partition([(0, 4), (4, 8), (8, 12)], [[0], [1], [2, 3]]), ["has 3 stages", "into 4 chunks"]),
    (partition([(0, 2), (2, 4), (4, 6), (6, 10)], [[0], [1], [2], [3]], layers=10),
     ["cuts a model of 10 layers", "gives 12"]),
    (partition([(0, 3), (3, 6), (6, 9), (9, 12)], [[0], [1], [2], [3, 4]], num_ranks=5),
     ["made for 5 ranks", "runs on 4"]),
], ids=["stage-count", "layer-count", "rank-count"])
def test_a_partition_that_does_not_fit_the_program_or_the_model_is_refused(tmp_path, capsys, no_launch, content,
                                                                           words):
    err = _run(["1f1b", "-D", "P=4", "-D", "N=4", "--partition", write(tmp_path, "p.json", content)], capsys)
    for word in words:
        assert word in err


def test_a_replicated_stage_the_program_does_not_replicate_is_refused(tmp_path, capsys, no_launch):
    alone = partition([(0, 6), (6, 9), (9, 12)], [[0], [1], [2, 3]])
    err = _run([write(tmp_path, "r.pipe", REPLICATED), "--partition", write(tmp_path, "p.json", alone)], capsys)
    assert "stage 0 runs on rank 0, but replicated places chunk 0 on ranks 0, 1" in err


def test_a_partition_for_a_spec_that_builds_its_own_chunks_is_refused(tmp_path, capsys, no_launch):
    status = main(["run", "1f1b", "-D", "P=4", "--partition", write(tmp_path, "p.json", UNEVEN)])
    err = capsys.readouterr().err
    assert status == 1 and "model spec pipec.runtime.model:LLAMA builds its own chunks (build_chunk)" in err


def test_a_partition_under_weight_passing_is_refused(tmp_path):
    program = compile_target("weipipe", {"P": 4}).program
    with pytest.raises(UsageError, match="weipipe is a weight-passing schedule"):
        cut_by_partition(SPEC, load_partition(write(tmp_path, "p.json", UNEVEN)), "p.json", program, MODEL)


def _broken(change) -> dict:
    content = json.loads(json.dumps(UNEVEN))
    change(content)
    return content


@pytest.mark.parametrize("content, words", [
    ("{\"format\": ", ["p.json:1:", "not valid JSON"]),
    ([1, 2], ["top level: expected an object, got an array"]),
    (_broken(lambda c: c.update(format="pipec costs")), ["format: expected 'pipec partition'"]),
    (_broken(lambda c: c.update(version=2)), ["version: this pipec reads version 1, got 2"]),
    (_broken(lambda c: c.pop("stages")), ["top level: missing stages"]),
    (_broken(lambda c: c.update(stage=[])), ["p.json: stage: unknown key"]),
    (_broken(lambda c: c["stages"][1].update(layers=[2, 3])), ["stages[1].layers: starts at layer 2", "stops at layer 1"]),
    (_broken(lambda c: c["stages"][2].update(layers=[3, 3])), ["stages[2].layers: expected [first, stop] with 3 < stop"]),
    (_broken(lambda c: c["stages"][3].update(layers=[7, 11])), ["stages[3].layers: the last stage stops at layer 11"]),
    (_broken(lambda c: c["stages"][0].update(replicas=0)), ["stages[0].replicas: expected an integer in 1 .. 4, got 0"]),
    (_broken(lambda c: c["stages"][0].update(ranks=[0, 1])), ["stages[0].ranks: expected one rank per replica, 1, got 2: [0, 1]"]),
    (_broken(lambda c: c["stages"][0].update(ranks=[7])), ["stages[0].ranks[0]: expected an integer in 0 .. 3, got 7"]),
    (_broken(lambda c: c["stages"][2].update(ranks=[3])), ["stages[2].ranks: expected the next 1 ranks, [2], got [3]"]),
    (_broken(lambda c: c.update(ranks=5)), ["stages: the stages' replicas add up to 4 ranks, and the partition is for 5"]),
    (_broken(lambda c: c["stages"][0].update(time="fast")), ["stages[0].time: expected a number, got the string 'fast'"]),
    (_broken(lambda c: c.update(names=["a"])), ["names: expected one name per layer, 12, got 1"]),
], ids=["not-json", "not-object", "format", "version", "missing", "unknown", "gap", "empty-stage", "short",
        "replicas", "ranks-count", "rank-range", "ranks-order", "ranks-sum", "time", "names"])
def test_a_malformed_partition_file_is_named_where_it_is_wrong(tmp_path, capsys, no_launch, content, words):
    path = write(tmp_path, "p.json", content)
    err = _run(["1f1b", "-D", "P=4", "-D", "N=4", "--partition", path], capsys)
    assert path in err
    for word in words:
        assert word in err


def test_a_partition_file_reads_back_what_it_says(tmp_path):
    read = load_partition(write(tmp_path, "p.json", REPLICAS))
    assert read.cut == ((0, 6), (6, 9), (9, 12)) and (read.layers, read.ranks) == (12, 4)
    assert [(s.replicas, s.ranks) for s in read.stages] == [(2, (0, 1)), (1, (2,)), (1, (3,))]
    assert read.names[0] == "layer0" and read.time_per_microbatch == 1.0


# ------------------------------------------------------------------ training on 4 processes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The batch of runs on 4 processes: (the WorkerRun, case -> saved state_dict path)."""
    folder = tmp_path_factory.mktemp("layered")
    uneven, replicas = write(folder, "uneven.json", UNEVEN), write(folder, "replicas.json", REPLICAS)
    program = write(folder, "replicated.pipe", REPLICATED)
    # profiled costs -> pipec partition --replicate -> the schedule it writes, run with its partition file
    profiled, generated = str(folder / "profiled.json"), str(folder / "generated.pipe")
    assert main(["partition", "--costs", write(folder, "costs.json", PROFILED), "-D", "P=4", "--replicate",
                 "-o", profiled, "--schedule-out", generated]) == 0
    common = ["--model", MODEL, "--seed", str(SEED), "--timeout", "60"]
    cases = {
        "1f1b": ["1f1b", "-D", "P=4", "-D", f"N={N}", "--steps", str(STEPS)],
        "interleaved": ["interleaved_1f1b", "-D", "P=4", "-D", "v=3", "-D", f"N={N}", "--steps", str(STEPS)],
        "uneven": ["1f1b", "-D", "P=4", "-D", f"N={N}", "--steps", str(STEPS), "--partition", uneven],
        "replicated": [program, "-D", f"N={N}", "--steps", str(STEPS), "--partition", replicas],
        "partitioned": [generated, "-D", f"N={N}", "--steps", str(STEPS), "--partition", profiled],
    }
    saves = {case: str(folder / f"{case}.pt") for case in cases}
    jobs = [[*argv, *common, "--save", saves[case]] for case, argv in cases.items()]
    # the interleaved run's checkpoint (12 chunks) goes on under the uneven cut (4 chunks) for 2 more steps
    saves["resumed"] = str(folder / "resumed.pt")
    jobs.append([*cases["uneven"][:-4], "--steps", str(STEPS + 2), "--partition", uneven, *common,
                 "--resume", saves["interleaved"], "--save", saves["resumed"]])
    run = launch_batch(jobs, 4, BATCH_DEADLINE_S, env={"PYTHONPATH": TESTS})
    assert run.ok, run.describe()
    saves["partition"] = profiled
    return run, saves


@functools.cache
def reference(steps: int) -> dict:
    """The one-process run's parameters after ``steps`` steps."""
    return reference_run(CONFIG, steps, N, SEED, spec=SPEC).state_dict


@pytest.mark.parametrize("case", ["1f1b", "interleaved", "uneven", "replicated", "partitioned"])
def test_a_model_given_by_its_layers_trains_like_one_process(trained, case):
    run, saves = trained
    want = reference(STEPS)
    assert_same_parameters(torch.load(saves[case]), want, case)
    initial = SPEC.build_model(CONFIG, SEED).state_dict()
    # every layer trained, by far more than the tolerance: a run that changed nothing could not match
    for layer in range(CONFIG.depth):
        name = f"{layer}.0.weight"
        assert (want[name] - initial[name]).abs().max() > 10 * TOLERANCE, name


def test_the_partitioner_replicates_the_slow_cheap_layers(trained):
    _, saves = trained
    read = load_partition(saves["partition"])
    assert [(s.first, s.stop, s.replicas, s.ranks) for s in read.stages] == [(0, 6, 3, (0, 1, 2)), (6, 12, 1, (3,))]
    assert read.time_per_microbatch == 6


def test_a_checkpoint_of_one_cut_resumes_under_another(trained):
    run, saves = trained
    want = reference(STEPS + 2)
    assert_same_parameters(torch.load(saves["resumed"]), want, "resumed")
    assert f"step {STEPS + 1} loss" in run.stdout[0]
