"""Training data from a model spec (``runtime/data.py``): the data sources, which ranks read what, the
data position, and the token-file example (``pipec.examples``).

* ``data_needs`` gives, per rank of a compiled program, exactly the
  microbatches whose inputs (first stages) and targets (last stages) it reads.
* The runtime's order of a dataset: deterministic, a permutation per epoch,
  wrapping from one epoch into the next; ``state_after`` / ``restore``
  continue exactly (a user's sampler too, stateful or not).
* A ``microbatch``-function spec trains 1F1B on 4 ranks like one process, and
  the two middle ranks never call the function.
* The token-file example: a token file made from ``docs/*.md`` by the script
  trains 1F1B and interleaved 1F1B (and a zigzag ring) within 1e-5 of one
  process, and its loss falls.
* The guarded reader's refusals of a token file and of the script's input;
  ``pipec run`` names a missing or bad token file before any worker starts.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, RandomSampler, SequentialSampler

import data_specs
from pipec.cli import main
from pipec.commands import run as run_command
from pipec.compiler import guarded_read, ops
from pipec.compiler.driver import compile_target
from pipec.errors import UsageError
from pipec.examples import make_tokens
from pipec.examples.token_file import SPEC, TokenConfig, TokenWindows
from pipec.runtime import data, model
from pipec.runtime.data import BatchSource, Needs, data_needs
from pipec.runtime.model import ModelConfig, ModelSpec, load_model_spec
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TOKEN_MODEL = "pipec.examples.token_file:SPEC"
SEED = 3
# Hard limit of one batch of multi-rank runs.
DEADLINE_S = 300.0
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, like every worker (the machine's cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _needs(program, rank: int) -> tuple[list[int], list[int]]:
    inputs, targets = data_needs(program, rank)
    return sorted(inputs), sorted(targets)


# ------------------------------------------------------------------ which ranks read what


def test_a_pipeline_reads_inputs_on_its_first_rank_and_targets_on_its_last():
    program = compile_target("1f1b", {"P": "4", "N": "8"}).program
    every = list(range(8))
    assert [_needs(program, r) for r in range(4)] == [(every, []), ([], []), ([], []), ([], every)]
    interleaved = compile_target("interleaved_1f1b", {"P": "2", "N": "4", "v": "2"}).program
    assert [_needs(interleaved, r) for r in range(2)] == [([0, 1, 2, 3], []), ([], [0, 1, 2, 3])]


def test_bidirectional_pipelines_read_each_pipelines_microbatches_where_it_starts_and_ends():
    # BitPipe's V: both ends of pipeline 0 on rank 0 (microbatches 0, 1), of pipeline 1 on rank 3
    bitpipe = compile_target("bitpipe", {"P": "4", "N": "4"}).program
    assert [_needs(bitpipe, r) for r in range(4)] == [([0, 1], [0, 1]), ([], []), ([], []), ([2, 3], [2, 3])]
    chimera = compile_target("chimera", {"P": "4", "N": "4"}).program
    assert [_needs(chimera, r) for r in range(4)] == [([0, 1], [2, 3]), ([], []), ([], []), ([2, 3], [0, 1])]


def test_weight_passing_ranks_read_their_own_microbatches_and_rings_the_whole_batch():
    weipipe = compile_target("weipipe", {"P": "4", "N": "8"}).program
    assert [_needs(weipipe, r) for r in range(4)] == [([r, r + 4], [r, r + 4]) for r in range(4)]
    ring = compile_target("zigzag_ring", {"P": "2"}).program
    assert [_needs(ring, r) for r in range(2)] == [([0], [0]), ([0], [0])]
    assert data.batch_microbatches(ring) == 1


def test_the_forwards_come_from_the_rule_table():
    # every compute op that makes the stage's activation reads the batch at a pipeline's ends, and only those
    assert data._FORWARDS == {op for op in ops.COMPUTE_OPS if ops.Use("act") in ops.RULES[op].writes}
    assert ops.F in data._FORWARDS and ops.B not in data._FORWARDS and ops.W not in data._FORWARDS


# ------------------------------------------------------------------ a dataset's order

ROWS = 10


class Rows(Dataset):
    """Row i is (tensor([i]), tensor([-i])); counts the reads."""

    def __init__(self, size: int = ROWS):
        self.size = size
        self.reads: list[int] = []

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.reads.append(index)
        return torch.tensor([index]), torch.tensor([-index])


def _dataset_spec(rows_per_microbatch: int = 2, sampler=None, dataset=None) -> ModelSpec:
    made = dataset if dataset is not None else Rows()
    return ModelSpec(model.build_chunk, model.build_model, None, model.loss_fn, model.make_optimizer,
                     config=ModelConfig(), dataset=lambda config, seed: made,
                     microbatch_rows=lambda config: rows_per_microbatch, sampler=sampler)


def _stream(source: BatchSource, step: int) -> list[int]:
    """The dataset indices of ``step``'s rows, microbatch by microbatch (inputs; targets are their negatives)."""
    inputs, targets = source.batch(step)
    out = []
    for x, y in zip(inputs, targets):
        assert torch.equal(y, -x)
        out += x.reshape(-1).tolist()
    return out


def test_the_default_order_is_a_seeded_permutation_per_epoch_that_wraps():
    spec = _dataset_spec()
    source = BatchSource(spec, spec.config, SEED, 3)  # 6 rows a step
    rows = [i for step in range(5) for i in _stream(source, step)]  # 30 positions: 3 epochs
    epochs = [rows[e * ROWS:(e + 1) * ROWS] for e in range(3)]
    assert all(sorted(epoch) == list(range(ROWS)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(ROWS))
    # step 1 is positions 6..11: the end of epoch 0, then the start of epoch 1
    assert _stream(source, 1) == epochs[0][6:] + epochs[1][:2]
    # deterministic: another source (another process) draws the same; another seed another order
    again = BatchSource(spec, spec.config, SEED, 3)
    assert [i for step in range(5) for i in _stream(again, step)] == rows
    other = BatchSource(spec, spec.config, SEED + 1, 3)
    assert _stream(other, 0) + _stream(other, 1)[:4] != epochs[0]
    # random access: step 4 alone, first, is the same rows
    assert _stream(BatchSource(spec, spec.config, SEED, 3), 4) == rows[24:30]


def test_a_rank_reads_only_the_rows_it_needs_and_gets_none_elsewhere():
    rows = Rows()
    spec = _dataset_spec(dataset=rows)
    full = BatchSource(spec, spec.config, SEED, 3).batch(2)
    rows.reads.clear()
    inputs, targets = BatchSource(spec, spec.config, SEED, 3, Needs(frozenset({1}), frozenset({2}))).batch(2)
    assert [x is None for x in inputs] == [True, False, True] and [y is None for y in targets] == [True, True, False]
    assert torch.equal(inputs[1], full[0][1]) and torch.equal(targets[2], full[1][2])
    assert sorted(rows.reads) == sorted(full[0][1].reshape(-1).tolist() + full[0][2].reshape(-1).tolist())
    rows.reads.clear()
    nothing = BatchSource(spec, spec.config, SEED, 3, Needs(frozenset(), frozenset()))
    assert nothing.batch(0) == ([None] * 3, [None] * 3)
    assert nothing.state_after(4) == {"source": "dataset", "steps": 4, "rows": 24}
    assert rows.reads == []  # nothing read, the dataset not even built


def test_state_after_and_restore_continue_exactly():
    spec = _dataset_spec()
    first = BatchSource(spec, spec.config, SEED, 3)
    batches = [_stream(first, step) for step in range(6)]
    state = first.state_after(3)
    assert state == {"source": "dataset", "steps": 3, "rows": 18}
    state = json.loads(json.dumps(state))  # what a checkpoint file gives back
    resumed = BatchSource(spec, spec.config, SEED, 3)
    resumed.restore(state)
    assert [_stream(resumed, step) for step in range(3, 6)] == batches[3:]
    assert resumed.state_after(5) == first.state_after(5)
    with pytest.raises(ValueError, match="step must be an int >= 3"):
        resumed.batch(2)
    # another N continues from the saved row: step 3 starts at position 18 of the same stream
    stream = [i for b in batches for i in b]
    wider = BatchSource(spec, spec.config, SEED, 2)
    wider.restore(state)
    assert _stream(wider, 3) + _stream(wider, 4) == stream[18:26]
    # function sources: the step alone
    synthetic = BatchSource(model.LLAMA, model.LLAMA.config, SEED, 2)
    assert synthetic.state_after(7) == {"source": "synthetic_batch", "steps": 7}


@pytest.mark.parametrize("state, words", [
    ({"source": "dataset", "steps": 1}, "holds rows, source, steps"),
    ({"source": "dataset", "steps": 1, "rows": 6, "epoch": 0}, "holds rows, source, steps"),
    ({"source": "microbatch", "steps": 1, "rows": 6}, "saved from a 'microbatch' data source"),
    ({"source": "dataset", "steps": -1, "rows": 6}, "steps is -1"),
    ({"source": "dataset", "steps": 1, "rows": 2.5}, "rows is 2.5"),
    ([1, 6], "got list"),
])
def test_restore_refuses_what_state_after_does_not_make(state, words):
    spec = _dataset_spec()
    with pytest.raises(UsageError, match=re.escape(words)):
        BatchSource(spec, spec.config, SEED, 3).restore(state)


class EpochSampler(torch.utils.data.Sampler):
    """Indices in order on even epochs, reversed on odd ones; records its set_epoch calls."""

    def __init__(self, size: int):
        self.size, self.epochs = size, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        order = list(range(self.size))
        return iter(order[::-1] if self.epochs[-1] % 2 else order)

    def __len__(self):
        return self.size


def test_a_users_sampler_is_iterated_identically_everywhere():
    made = []
    spec = _dataset_spec(sampler=lambda config, dataset, seed: made.append(EpochSampler(len(dataset))) or made[-1])
    source = BatchSource(spec, spec.config, SEED, 3)
    rows = [i for step in range(4) for i in _stream(source, step)]
    assert rows == list(range(10)) + list(range(9, -1, -1)) + list(range(4))
    assert made[0].epochs == [0, 1, 2]
    # torch's global generator is seeded per epoch while a sampler draws, and left as it was: RandomSampler
    # without a generator gives every rank the same order, whatever the rank drew before
    spec = _dataset_spec(sampler=lambda config, dataset, seed: RandomSampler(dataset))
    orders = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        orders.append([i for step in range(4) for i in _stream(BatchSource(spec, spec.config, SEED, 3), step)])
        assert torch.equal(torch.get_rng_state(), before)
    assert orders[0] == orders[1]
    assert sorted(orders[0][:10]) == list(range(10)) and orders[0][:10] != orders[0][10:20]


def test_a_stateful_sampler_continues_exactly_after_restore():
    # its own generator advances with every pass: epoch e's order depends on the passes before it
    spec = _dataset_spec(sampler=lambda config, dataset, seed: RandomSampler(
        dataset, num_samples=7, generator=torch.Generator().manual_seed(seed)))
    first = BatchSource(spec, spec.config, SEED, 3)
    batches = [_stream(first, step) for step in range(6)]
    epochs = [i for b in batches for i in b]
    assert len(set(epochs[:7])) <= 7 and epochs[:7] != epochs[7:14]  # 7 rows an epoch
    resumed = BatchSource(spec, spec.config, SEED, 3)
    resumed.restore(first.state_after(4))
    assert [_stream(resumed, step) for step in (4, 5)] == batches[4:]
    first.restore(first.state_after(1))  # back to an epoch it has dropped: drawn again from epoch 0
    assert _stream(first, 1) == batches[1]


@pytest.mark.parametrize("sampler, words", [
    (lambda config, dataset, seed: BatchSampler(SequentialSampler(dataset), 2, False), "a batch sampler yields lists"),
    (lambda config, dataset, seed: [0, 99], "index 99 in epoch 0, outside the dataset's 10 rows"),
    (lambda config, dataset, seed: [], "yielded no index in epoch 0"),
    (lambda config, dataset, seed: 5, "returned a int, which cannot be iterated"),
])
def test_a_sampler_that_does_not_yield_indices_is_named(sampler, words):
    spec = _dataset_spec(sampler=sampler)
    with pytest.raises(UsageError, match=re.escape(words)):
        BatchSource(spec, spec.config, SEED, 3).batch(0)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(())


@pytest.mark.parametrize("dataset, words", [
    (Stream(), "not a map-style dataset"),
    (Rows(0), "len(dataset) is 0; a dataset needs at least one row"),
    ([1, 2, 3], "] returned (int), not (inputs, targets)"),
    ([(torch.zeros(2), torch.zeros(2)), (torch.zeros(3), torch.zeros(3))] * 3, "do not stack into one tensor"),
])
def test_a_dataset_of_the_wrong_form_is_named(dataset, words):
    spec = _dataset_spec(dataset=dataset)
    with pytest.raises(UsageError, match=re.escape(words)):
        BatchSource(spec, spec.config, 0, 3, name="mine").batch(0)


# ------------------------------------------------------------------ the model spec's data source


def test_a_spec_has_exactly_one_data_source():
    parts = dict(build_chunk=model.build_chunk, build_model=model.build_model, loss_fn=model.loss_fn,
                 make_optimizer=model.make_optimizer)
    with pytest.raises(UsageError, match="one data source, synthetic_batch, microbatch or dataset, and this one has none"):
        ModelSpec(**parts)
    with pytest.raises(UsageError, match="exactly one data source, and this one has 2: synthetic_batch and dataset"):
        ModelSpec(**parts, synthetic_batch=model.synthetic_batch, dataset=lambda c, s: Rows())
    with pytest.raises(UsageError, match="sampler only applies to a dataset, and its data come from microbatch"):
        ModelSpec(**parts, microbatch=data_specs.microbatch, sampler=lambda c, d, s: [0])
    with pytest.raises(UsageError, match="loss_fn"):
        ModelSpec(model.build_chunk, model.build_model, model.synthetic_batch, None, model.make_optimizer)
    # the positional form of before still works, and says where its data come from
    spec = ModelSpec(model.build_chunk, model.build_model, model.synthetic_batch, model.loss_fn, model.make_optimizer,
                     config=ModelConfig())
    assert spec.data_source == "synthetic_batch" and data_specs.MICROBATCH.data_source == "microbatch"
    assert SPEC.data_source == "dataset"


def test_a_module_with_any_one_data_source_is_a_spec(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ("from pipec.runtime.model import build_chunk, build_model, loss_fn, make_optimizer, ModelConfig\n"
              "config = ModelConfig()\n")
    (tmp_path / "pipec_test_mb_module.py").write_text(common + "from data_specs import microbatch\n")
    (tmp_path / "pipec_test_two_sources.py").write_text(
        common + "from pipec.runtime.model import synthetic_batch\nfrom data_specs import microbatch\n")
    (tmp_path / "pipec_test_no_source.py").write_text(common)
    try:
        assert load_model_spec("pipec_test_mb_module").data_source == "microbatch"
        with pytest.raises(UsageError, match="pipec_test_two_sources: .*2: synthetic_batch and microbatch"):
            load_model_spec("pipec_test_two_sources")
        with pytest.raises(UsageError, match=r"missing or not callable: a data source \(synthetic_batch, microbatch"):
            load_model_spec("pipec_test_no_source")
    finally:
        for name in ("pipec_test_mb_module", "pipec_test_two_sources", "pipec_test_no_source"):
            sys.modules.pop(name, None)


def test_a_microbatch_function_is_called_only_for_what_is_needed():
    calls = []
    spec = ModelSpec(model.build_chunk, model.build_model, None, model.loss_fn, model.make_optimizer,
                     config=ModelConfig(), microbatch=lambda *args: calls.append(args[1:3]) or data_specs.microbatch(*args))
    inputs, targets = BatchSource(spec, spec.config, 0, 4, Needs(frozenset({0, 2}), frozenset({2}))).batch(5)
    assert calls == [(5, 0), (5, 2)]
    assert [x is not None for x in inputs] == [True, False, True, False] and targets[2] is not None
    assert torch.equal(inputs[2], data_specs.microbatch(spec.config, 5, 2, 4, 0)[0])
    bad = ModelSpec(model.build_chunk, model.build_model, None, model.loss_fn, model.make_optimizer,
                    config=ModelConfig(), microbatch=lambda *args: torch.zeros(2))
    with pytest.raises(UsageError, match=re.escape("model spec m: microbatch(config, 0, 0, 4, seed) returned (Tensor)")):
        BatchSource(bad, bad.config, 0, 4, name="m").batch(0)


# ------------------------------------------------------------------ the token file and the script


@pytest.fixture(scope="module")
def docs_tokens(tmp_path_factory) -> Path:
    """A token file made by the script from docs/*.md (their text, concatenated)."""
    folder = tmp_path_factory.mktemp("tokens")
    text = folder / "docs.txt"
    text.write_bytes(b"".join(path.read_bytes() for path in sorted((ROOT / "docs").glob("*.md"))))
    out = folder / "tokens.bin"
    done = subprocess.run([sys.executable, "-m", "pipec.examples.make_tokens", str(text), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    size = text.stat().st_size
    assert done.stdout.splitlines() == [
        f"{out}: {size:,} tokens (byte-level, ids 0..255, uint16) from {text}",
        f"train on them: pipec run 1f1b -D P=4 -D N=8 --model {TOKEN_MODEL} --config token_file={out}",
    ]
    tokens = numpy.fromfile(out, dtype="<u2")
    assert tokens.tolist() == list(text.read_bytes())
    return out


def test_a_token_files_rows_are_its_windows_shifted_by_one(docs_tokens):
    windows = TokenWindows(str(docs_tokens), "uint16", 16, 256)
    tokens = numpy.fromfile(docs_tokens, dtype="<u2")
    assert len(windows) == (len(tokens) - 1) // 16
    x, y = windows[3]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (16,)
    assert x.tolist() == tokens[48:64].tolist() and y.tolist() == tokens[49:65].tolist()
    last = len(windows) - 1
    assert windows[last][1][-1] == int(tokens[last * 16 + 16])
    with pytest.raises(IndexError):
        windows[len(windows)]


def _token_file(path: Path, ids, dtype: str = "<u2") -> str:
    numpy.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


def test_the_guarded_reader_refuses_what_is_not_a_token_file(tmp_path):
    with pytest.raises(UsageError, match="a folder; expected a token file"):
        TokenWindows(str(tmp_path), "uint16", 16, 256)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):  # refused without waiting for a writer
        TokenWindows(str(fifo), "uint16", 16, 256)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(UsageError, match="3 bytes is not a whole number of uint16 token ids"):
        TokenWindows(str(odd), "uint16", 1, 256)
    short = _token_file(tmp_path / "short.bin", range(16))
    with pytest.raises(UsageError, match=re.escape("16 token ids, fewer than the 17 needed (one window: seq_len + 1 = 17)")):
        TokenWindows(short, "uint16", 16, 256)
    with pytest.raises(UsageError, match="token dtype 'int64' is not one of uint16, uint32, int32"):
        guarded_read.map_tokens(short, "int64", 1)
    with pytest.raises(UsageError, match="cannot read the token file '.*nope.bin': no such file"):
        TokenWindows(str(tmp_path / "nope.bin"), "uint16", 16, 256)
    big = tmp_path / "big.bin"
    with open(big, "wb") as handle:  # sparse: no time spent writing it
        handle.truncate(guarded_read.TOKENS.limit + 2)
    with pytest.raises(UsageError, match="over the 64 GiB limit for a token file"):
        TokenWindows(str(big), "uint16", 16, 256)


def test_a_token_outside_the_vocabulary_is_named_when_its_window_is_read(tmp_path):
    ids = [7] * 100
    ids[40] = 300
    path = _token_file(tmp_path / "t.bin", ids)
    windows = TokenWindows(path, "uint16", 16, 256)  # opening reads nothing
    assert windows[0][0].tolist() == [7] * 16
    with pytest.raises(UsageError, match=re.escape(f"token file '{path}': token 300 at index 40 is outside the "
                                                   "vocabulary of 256 ids (0 .. 255)")):
        windows[2]
    signed = _token_file(tmp_path / "s.bin", [5, -1] + [5] * 20, dtype="<i4")
    with pytest.raises(UsageError, match="token -1 at index 1"):
        TokenWindows(signed, "int32", 16, 256)[0]
    config = TokenConfig(token_file=path)
    source = BatchSource(SPEC, config, 0, 3, name=TOKEN_MODEL)
    with pytest.raises(UsageError, match=f"model spec {re.escape(TOKEN_MODEL)}: token file .* token 300 at index 40 "
                                         r".* \(the batch of training step [123]\)$"):
        for step in range(3):  # 6 windows of 16, 18 rows: window 2 is read within 3 steps
            source.batch(step)


def test_token_config_refuses_a_dtype_it_cannot_read():
    with pytest.raises(UsageError, match="token_dtype must be one of uint16, uint32, int32, got 'float32'"):
        TokenConfig(token_dtype="float32")
    assert TokenConfig().vocab == 256 and isinstance(TokenConfig(), ModelConfig)


@pytest.mark.parametrize("config, words", [
    ([], "model spec pipec.examples.token_file:SPEC: no token file to train on: pass --config token_file=PATH "
         "(make one from any text file with: python -m pipec.examples.make_tokens INPUT.txt -o tokens.bin)"),
    (["token_file=NOPE"], "model spec pipec.examples.token_file:SPEC: cannot read the token file 'NOPE': no such file"),
    (["token_file=BAD", "token_dtype=int64"], "model config: token_dtype must be one of uint16, uint32, int32, "
                                              "got 'int64'"),
    (["token_file=BAD"], "model spec pipec.examples.token_file:SPEC: token file 'BAD': token 300 at index "),
])
def test_pipec_run_names_a_bad_token_file_before_any_worker_starts(tmp_path, capsys, no_launch, config, words):
    bad = _token_file(tmp_path / "bad.bin", [300] * 200)
    given = [item.replace("NOPE", str(tmp_path / "nope.bin")).replace("BAD", bad) for item in config]
    options = [part for item in given for part in ("--config", item)]
    assert main(["run", "1f1b", "-D", "P=2", "-D", "N=2", "--model", TOKEN_MODEL, *options]) == 1
    err = capsys.readouterr().err
    expected = words.replace("NOPE", str(tmp_path / "nope.bin")).replace("BAD", bad)
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("content, words", [
    (None, "cannot read the text file '{path}': no such file"),
    (b"", "{path}: the text file is empty: there are no tokens to make"),
    (b"caf\xc3\xa9\nna\xefve\n", "{path}:2:3: the text file is not UTF-8 text (byte 0xef)"),
    (b"text\x00\x01", "{path}: byte 4 is NUL: a binary file, not text"),
])
def test_the_script_refuses_what_it_cannot_make_tokens_of(tmp_path, capsys, content, words):
    path = tmp_path / "in.txt"
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "tokens.bin"
    out.write_bytes(b"old")
    assert make_tokens.main([str(path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == words.format(path=path) + "\n"
    assert out.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == sorted(
        ["tokens.bin"] + (["in.txt"] if content is not None else []))
    assert make_tokens.main([str(tmp_path), "-o", str(out)]) == 1
    assert "a folder; expected a text file" in capsys.readouterr().err


def test_the_script_streams_a_file_larger_than_a_chunk(tmp_path, monkeypatch):
    text = ("é and ü, " * 40_000).encode()  # two-byte characters cut across chunk boundaries
    source = tmp_path / "big.txt"
    source.write_bytes(text)
    monkeypatch.setattr(guarded_read, "STREAM_CHUNK", 4099)
    assert make_tokens.make_tokens(str(source), str(tmp_path / "t.bin")) == len(text)
    assert numpy.fromfile(tmp_path / "t.bin", dtype="<u2").tobytes() == numpy.frombuffer(text, numpy.uint8).astype("<u2").tobytes()


# ------------------------------------------------------------------ multi-rank training

TOKEN_RUNS = {  # name -> (worker arguments, N of the reference)
    "1f1b-P2": (["1f1b", "-D", "P=2", "-D", "N=4"], 4),
    "interleaved-P2-v2": (["interleaved_1f1b", "-D", "P=2", "-D", "N=4", "-D", "v=2"], 4),
    "zigzag-P2": (["zigzag_ring", "-D", "P=2"], 1),
}
TOKEN_STEPS = 5


def _job(schedule: list[str], steps: int, save: Path, model_args: list[str]) -> list[str]:
    return [*schedule, "--steps", str(steps), "--seed", str(SEED), "--timeout", "60", "--save", str(save),
            *model_args]


def _job_losses(stdout: str) -> list[list[float]]:
    """Rank 0's losses per job of a batch (``job I done`` ends each)."""
    parts = re.split(r"^job \d+ done$", stdout, flags=re.M)[:-1]
    return [[float(value) for _, value in STEP_LINE.findall(part)] for part in parts]


def _pythonpath() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def token_runs(docs_tokens, tmp_path_factory):
    """One set of 2 processes trains every TOKEN_RUNS case on the docs' token file; (run, saves, losses)."""
    folder = tmp_path_factory.mktemp("token_runs")
    saves = {name: folder / f"{name}.pt" for name in TOKEN_RUNS}
    model_args = ["--model", TOKEN_MODEL, "--config", f"token_file={docs_tokens}"]
    jobs = [_job(schedule, TOKEN_STEPS, saves[name], model_args) for name, (schedule, _) in TOKEN_RUNS.items()]
    run = launch_batch(jobs, 2, DEADLINE_S, env=_pythonpath())
    assert run.ok, run.describe()
    return run, saves, dict(zip(TOKEN_RUNS, _job_losses(run.stdout[0])))


@pytest.mark.parametrize("name", list(TOKEN_RUNS))
def test_training_on_a_token_file_is_exact_and_the_loss_falls(token_runs, docs_tokens, name):
    run, saves, losses = token_runs
    _, num_microbatches = TOKEN_RUNS[name]
    reference = reference_run(TokenConfig(token_file=str(docs_tokens)), TOKEN_STEPS, num_microbatches, SEED, SPEC)
    assert_same_parameters(torch.load(saves[name]), reference.state_dict, name)
    assert losses[name] == pytest.approx(reference.losses, abs=1e-5), (losses[name], reference.losses)
    assert len(losses[name]) == TOKEN_STEPS and losses[name][-1] < losses[name][0], losses[name]


def test_a_microbatch_function_trains_exactly_and_middle_ranks_never_call_it(tmp_path):
    log = tmp_path / "calls"
    log.mkdir()
    steps, n = 3, 4
    save = tmp_path / "mb.pt"
    schedule = ["1f1b", "-D", "P=4", "-D", f"N={n}"]
    # as `pipec run` starts them: with the compiled program, so no worker checks the model (the parent did)
    program = run_command.write_program(compile_target("1f1b", {"P": "4", "N": str(n)}).program, str(tmp_path))
    job = _job(schedule, steps, save, ["--model", "data_specs:MICROBATCH", "--program", program])
    run = launch_batch([job], 4, DEADLINE_S, env={**_pythonpath(), data_specs.CALL_LOG: str(log)})
    assert run.ok, run.describe()
    reference = reference_run(ModelConfig(), steps, n, SEED, data_specs.MICROBATCH)
    assert_same_parameters(torch.load(save), reference.state_dict, "microbatch spec, 1f1b P=4")
    assert _job_losses(run.stdout[0])[0] == pytest.approx(reference.losses, abs=1e-5)
    # rank 0 read every microbatch's inputs, rank 3 every microbatch's targets, ranks 1 and 2 nothing
    every = {(step, m) for step in range(steps) for m in range(n)}
    assert data_specs.calls(log, 0) == every and data_specs.calls(log, 3) == every
    assert data_specs.calls(log, 1) == data_specs.calls(log, 2) == set()
