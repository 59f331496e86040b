"""The runtime's model and its one-process trainer: what a pipelined run is compared with."""
from __future__ import annotations

import math
import pickle
import sys
import textwrap

import pytest
import torch

from pipec.errors import UsageError
from pipec.runtime.model import (
    DEFAULT_MODEL,
    LLAMA,
    ModelConfig,
    ModelSpec,
    activation_shape,
    build_chunk,
    build_model,
    chunk_layers,
    count_parameters,
    describe,
    load_model_spec,
    loss_fn,
    make_optimizer,
    split_microbatches,
    synthetic_batch,
    task_permutation,
)
from pipec.runtime.reference import reference_run, train_reference

CONFIG = ModelConfig()


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, like every torchrun worker: on a loaded 2-core machine,
    torch's intra-op threads otherwise wait on each other for milliseconds per kernel."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _chunks(num_chunks: int, seed: int = 0, config: ModelConfig = CONFIG):
    return [build_chunk(config, c, num_chunks, seed) for c in range(num_chunks)]


# ------------------------------------------------------------------ the cut


def test_chunk_layers_split_evenly_and_cover_every_layer_once():
    for num_chunks in (1, 2, 4, 8):
        ranges = [chunk_layers(CONFIG, c, num_chunks) for c in range(num_chunks)]
        assert [i for r in ranges for i in r] == list(range(CONFIG.layers))
        assert {len(r) for r in ranges} == {CONFIG.layers // num_chunks}


@pytest.mark.parametrize("chunk, num_chunks", [(0, 3), (0, 16), (4, 4), (-1, 2), (0, 0)])
def test_chunk_layers_rejects_uneven_cuts_and_bad_chunks(chunk, num_chunks):
    with pytest.raises(UsageError):
        chunk_layers(CONFIG, chunk, num_chunks)


@pytest.mark.parametrize("changes", [{"dim": 30}, {"heads": 3}, {"heads": 32}, {"layers": 0}, {"vocab": 0}])
def test_config_rejects_sizes_the_model_cannot_have(changes):
    with pytest.raises(UsageError):
        ModelConfig(**changes)


@pytest.mark.parametrize("num_chunks", [1, 2, 4, 8])
def test_chunks_hold_the_full_models_parameters_bit_for_bit(num_chunks):
    full = build_model(CONFIG, seed=3).state_dict()
    seen: set[str] = set()
    for c, chunk in enumerate(_chunks(num_chunks, seed=3)):
        state = chunk.state_dict()
        assert not seen & state.keys(), "two chunks hold the same parameter"
        seen |= state.keys()
        for name, tensor in state.items():
            assert torch.equal(tensor, full[name]), name
        assert ("embed.weight" in state) == (c == 0)
        assert ("head.weight" in state) == ("norm.weight" in state) == (c == num_chunks - 1)
        expected_layers = {str(i) for i in chunk_layers(CONFIG, c, num_chunks)}
        assert {name.split(".")[1] for name in state if name.startswith("layers.")} == expected_layers
    assert seen == full.keys()


def test_state_dict_holds_parameters_only():
    model = build_model(CONFIG, 0)
    assert list(model.state_dict()) == [name for name, _ in model.named_parameters()]
    assert count_parameters(model) == sum(t.numel() for t in model.state_dict().values())


def test_initialisation_depends_on_the_seed_and_the_layer_not_on_torchs_global_generator():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a = build_model(CONFIG, 0).state_dict()
    assert torch.equal(torch.get_rng_state(), before), "building a model drew from the global generator"
    torch.manual_seed(2)
    b = build_model(CONFIG, 0).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other_seed = build_model(CONFIG, 1).state_dict()
    assert not torch.equal(a["layers.0.attn.wqkv.weight"], other_seed["layers.0.attn.wqkv.weight"])
    assert not torch.equal(a["layers.0.attn.wqkv.weight"], a["layers.1.attn.wqkv.weight"])
    assert torch.equal(a["layers.0.attn_norm.weight"], torch.ones(CONFIG.dim))


@pytest.mark.parametrize("num_chunks", [2, 4, 8])
def test_chunks_in_sequence_compute_the_full_model_exactly(num_chunks):
    """Forward through the chunks with a cut at each boundary, then backward
    stage by stage (as a pipeline does): the loss and every gradient equal the
    whole model's."""
    inputs, targets = split_microbatches(synthetic_batch(CONFIG, 0, 2, seed=5), 2)[1]
    full = build_model(CONFIG, 5)
    full_loss = loss_fn(full(inputs), targets)
    full_loss.backward()

    chunks = _chunks(num_chunks, seed=5)
    sent, received, x = [], [], inputs
    for chunk in chunks:
        if x.is_floating_point():
            assert tuple(x.shape) == activation_shape(CONFIG)
            x = x.detach().requires_grad_()
        received.append(x)
        x = chunk(x)
        sent.append(x)
    loss = loss_fn(x, targets)
    assert torch.equal(loss, full_loss)
    loss.backward()
    for c in range(num_chunks - 2, -1, -1):
        sent[c].backward(received[c + 1].grad)

    full_grads = {name: p.grad for name, p in full.named_parameters()}
    for chunk in chunks:
        for name, parameter in chunk.named_parameters():
            assert torch.allclose(parameter.grad, full_grads[name], rtol=0, atol=1e-6), name


def _causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_positions_and_attend_of_the_whole_sequence_are_the_default_forward_bit_for_bit():
    """The sequence-ring hook (``forward(x, positions, attend)``) with every position and the model's own
    attention computes what ``forward(x)`` does, forward and backward."""
    inputs, targets = synthetic_batch(CONFIG, 0, 1, seed=2)
    results = []
    for hooked in (False, True):
        model = build_model(CONFIG, 2)
        extra = {"positions": torch.arange(CONFIG.seq_len), "attend": _causal} if hooked else {}
        logits = model(inputs, **extra)
        loss_fn(logits, targets).backward()
        results.append((logits, {name: p.grad for name, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want)
    assert all(torch.equal(got_grads[name], want_grads[name]) for name in want_grads)


def test_positions_turn_each_token_by_its_global_position():
    """The sequence reversed, given with its positions, and attention that puts the tokens back in order:
    the whole model's outputs, reversed. With the positions of their new places instead, they differ."""
    model = build_model(CONFIG, 3)
    inputs, _ = synthetic_batch(CONFIG, 1, 1, seed=3)
    order = torch.arange(CONFIG.seq_len).flip(0)
    back = torch.argsort(order)

    def attend(q, k, v):  # q, k, v hold the tokens at ``order``: attend in ascending positions, then return
        return _causal(q[..., back, :], k[..., back, :], v[..., back, :])[..., order, :]

    with torch.no_grad():
        want = model(inputs)[:, order]
        got = model(inputs[:, order], positions=order, attend=attend)
        wrong = model(inputs[:, order], positions=torch.arange(CONFIG.seq_len), attend=attend)
    assert (got - want).abs().max().item() <= 1e-5
    assert (wrong - want).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="one per token"):
        model(inputs, positions=torch.arange(3), attend=attend)


def test_a_chunk_survives_pickling():
    chunk = build_chunk(CONFIG, 1, 4, seed=0)
    copy = pickle.loads(pickle.dumps(chunk))
    x = torch.randn(activation_shape(CONFIG))
    assert torch.equal(chunk(x), copy(x))
    assert chunk.state_dict().keys() == copy.state_dict().keys()


# ------------------------------------------------------------------ the task


def test_synthetic_batch_is_deterministic_per_seed_and_step():
    n = 4
    inputs, targets = synthetic_batch(CONFIG, 2, n, seed=0)
    assert inputs.shape == targets.shape == (n * CONFIG.microbatch_size, CONFIG.seq_len)
    assert inputs.dtype == targets.dtype == torch.long
    again = synthetic_batch(CONFIG, 2, n, seed=0)
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    assert not torch.equal(inputs, synthetic_batch(CONFIG, 3, n, seed=0)[0])
    assert not torch.equal(inputs, synthetic_batch(CONFIG, 2, n, seed=1)[0])
    assert torch.equal(targets, task_permutation(CONFIG, 0)[inputs])
    assert sorted(task_permutation(CONFIG, 0).tolist()) == list(range(CONFIG.vocab))
    assert 0 <= int(inputs.min()) and int(inputs.max()) < CONFIG.vocab


def test_split_microbatches_cuts_rows_in_order():
    inputs, targets = synthetic_batch(CONFIG, 0, 3, seed=0)
    pieces = split_microbatches((inputs, targets), 3)
    assert len(pieces) == 3
    for m, (x, y) in enumerate(pieces):
        rows = slice(m * CONFIG.microbatch_size, (m + 1) * CONFIG.microbatch_size)
        assert torch.equal(x, inputs[rows]) and torch.equal(y, targets[rows])


def test_loss_falls_clearly_within_ten_reference_steps():
    losses = reference_run(CONFIG, steps=10, num_microbatches=4, seed=0).losses
    assert abs(losses[0] - math.log(CONFIG.vocab)) < 0.1, "the first loss should be that of a uniform guess"
    assert losses[-1] < 0.75 * losses[0], losses
    assert losses[4] < losses[0], losses


# ------------------------------------------------------------ the reference


def test_reference_is_deterministic_and_keyed_like_the_model():
    a = train_reference(CONFIG, 2, 2, seed=0)
    b = train_reference(CONFIG, 2, 2, seed=0)
    assert list(a) == list(build_model(CONFIG, 0).state_dict())
    assert all(torch.equal(a[k], b[k]) for k in a)
    initial = build_model(CONFIG, 0).state_dict()
    assert not torch.equal(a["layers.3.mlp.w13.weight"], initial["layers.3.mlp.w13.weight"]), "no training happened"


def test_reference_step_is_the_gradient_of_the_mean_loss_over_the_batch():
    """Scaling each microbatch's loss by 1/N makes the accumulated gradient that
    of the batch's mean loss (equal microbatches): one step on the whole batch
    at once must land on the same parameters."""
    n = 4
    stepped = train_reference(CONFIG, 1, n, seed=2)
    model = build_model(CONFIG, 2)
    optimizer = make_optimizer(model.parameters())
    inputs, targets = synthetic_batch(CONFIG, 0, n, seed=2)
    loss_fn(model(inputs), targets).backward()
    optimizer.step()
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter.detach(), stepped[name], rtol=0, atol=1e-6), name


def test_reference_runs_a_users_spec():
    calls = []

    def build(config, seed):
        calls.append(("build_model", config, seed))
        return build_model(CONFIG, seed)

    spec = ModelSpec(build_chunk, build, synthetic_batch, loss_fn, make_optimizer, config=CONFIG)
    state = train_reference(CONFIG, 1, 2, seed=4, spec=spec)
    assert calls == [("build_model", CONFIG, 4)]
    assert all(torch.equal(state[k], v) for k, v in train_reference(CONFIG, 1, 2, seed=4).items())


# ------------------------------------------------------------- the model spec


def test_describe_states_the_parameter_count():
    line = describe(CONFIG)
    assert "\n" not in line
    assert f"{count_parameters(build_model(CONFIG, 0)):,} parameters" in line
    assert LLAMA.summary() == line


def test_default_model_text_loads_the_builtin_spec():
    assert load_model_spec(DEFAULT_MODEL) is LLAMA
    assert LLAMA.activation_shape(LLAMA.config) == (CONFIG.microbatch_size, CONFIG.seq_len, CONFIG.dim)


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Write modules into a directory on sys.path; forget them afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_a_module_with_the_five_functions_is_a_spec(user_modules):
    name = user_modules(
        "pipec_test_user_model",
        """
        from pipec.runtime.model import ModelConfig, build_chunk, build_model, synthetic_batch, loss_fn, make_optimizer
        config = ModelConfig(layers=4)
        """,
    )
    spec = load_model_spec(name)
    assert spec.config == ModelConfig(layers=4)
    assert spec.describe is None and spec.activation_shape is None
    assert "pipec.runtime.model" in spec.summary()
    assert spec.build_chunk(spec.config, 1, 2, 0).layer_range == range(2, 4)


def test_an_attribute_holding_an_object_with_the_functions_is_a_spec(user_modules):
    name = user_modules(
        "pipec_test_user_object",
        """
        from types import SimpleNamespace
        from pipec.runtime import model
        SPEC = SimpleNamespace(build_chunk=model.build_chunk, build_model=model.build_model,
                               synthetic_batch=model.synthetic_batch, loss_fn=model.loss_fn,
                               make_optimizer=model.make_optimizer, config=model.ModelConfig(dim=16),
                               describe=lambda config: "mine")
        """,
    )
    spec = load_model_spec(f"{name}:SPEC")
    assert spec.config.dim == 16 and spec.summary() == "mine"


@pytest.mark.parametrize(
    "text, words",
    [
        ("pipec_no_such_module_anywhere:SPEC", ["cannot import", "pipec_no_such_module_anywhere"]),
        ("pipec.runtime.model:NO_SUCH", ["no attribute", "NO_SUCH"]),
        ("pipec.runtime.model:", ["package.module:attribute"]),
        (":LLAMA", ["package.module:attribute"]),
        ("pipec.runtime.model:ModelConfig", ["missing or not callable", "build_chunk", "make_optimizer"]),
    ],
)
def test_load_model_spec_says_what_is_wrong(text, words):
    with pytest.raises(UsageError) as caught:
        load_model_spec(text)
    for word in words:
        assert word in str(caught.value)


def test_a_module_that_fails_to_import_is_a_usage_error(user_modules):
    name = user_modules("pipec_test_broken_model", "raise RuntimeError('no GPU here')\n")
    with pytest.raises(UsageError, match="cannot import.*RuntimeError: no GPU here"):
        load_model_spec(f"{name}:SPEC")


def test_a_spec_missing_one_function_names_it(user_modules):
    name = user_modules(
        "pipec_test_partial_model",
        """
        from pipec.runtime.model import build_chunk, build_model, synthetic_batch, loss_fn
        make_optimizer = 3
        """,
    )
    with pytest.raises(UsageError, match="missing or not callable: make_optimizer \\("):
        load_model_spec(name)
