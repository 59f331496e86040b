"""pipec profile (runtime/profile.py): the built-in model's layers are the model's, their measured times add up
to the whole model's forward and backward, and the cost file it writes is exact in bytes and read by the
partitioner; a user's nn.Sequential is measured too, and a spec without layers is a clear error."""
from __future__ import annotations

import textwrap

import torch

from pipec.cli import main
from pipec.compiler.costs import load_costs
from pipec.runtime.model import LLAMA, ModelConfig, build_model, llama_layers, synthetic_batch
from pipec.runtime.profile import profile_layers

# a tiny decoder: the measurement is a unit test, not a benchmark
TINY = ModelConfig(layers=2)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_built_in_models_layers_are_the_model_name_for_name_and_compute_its_forward():
    layers = llama_layers(TINY, 5)
    assert list(dict(layers.named_children())) == ["embed", "layer0", "layer1", "head"]
    merged = {}
    for layer in layers:
        merged.update(layer.state_dict())
    whole = build_model(TINY, 5)
    expected = whole.state_dict()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)
    tokens, _ = synthetic_batch(TINY, 0, 1, 5)
    assert torch.equal(layers(tokens), whole(tokens))


def test_every_layer_is_timed_and_the_whole_model_too():
    # the sum against the whole is a figure, not a property: benchmarks/model_speed.py prints it
    measured = profile_layers(LLAMA, TINY, 0, repeats=3)
    assert [layer.name for layer in measured.layers] == ["embed", "layer0", "layer1", "head"]
    assert all(layer.F > 0 and layer.B > 0 for layer in measured.layers) and measured.whole > 0


def test_profile_writes_a_cost_file_of_exact_bytes_that_partition_reads(capsys, tmp_path):
    path = tmp_path / "costs.json"
    status, out, err = run(capsys, "profile", "--config", "layers=2", "--repeats", "2", "-o", str(path))
    assert status == 0, err
    assert "sum / whole" in out and f"wrote {path}" in out
    layers = load_costs(str(path)).layers
    assert [layer.name for layer in layers] == ["embed", "layer0", "layer1", "head"]
    hidden = 4 * 16 * 32 * 4  # a microbatch of 4 sequences of 16 tokens, dim 32, fp32
    assert [layer.activation for layer in layers] == [hidden, hidden, hidden, 4 * 16 * 64 * 4]  # logits: vocab 64
    per_layer = (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) * 4  # wqkv, wo, w13, w2 and two norms
    assert [layer.parameters for layer in layers] == [64 * 32 * 4, per_layer, per_layer, (32 + 32 * 64) * 4]
    status, out, err = run(capsys, "partition", "--costs", str(path), "-D", "P=2")
    assert status == 0 and "embed" in out and "head" in out, err


SPECS = '''
import torch
from dataclasses import replace
from torch import nn
from pipec.runtime.model import LLAMA, ModelSpec

def _layers(config, seed):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

def _model(config, seed):
    return _layers(config, seed)

def _batch(config, step, m, count, seed):
    generator = torch.Generator().manual_seed(step * 100 + m)
    return torch.randn(3, 8, generator=generator), torch.randn(3, 4, generator=generator)

MLP = ModelSpec(build_chunk=lambda c, i, n, s: _model(c, s), build_model=_model, loss_fn=nn.functional.mse_loss,
                make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), microbatch=_batch, layers=_layers)
NO_LAYERS = replace(LLAMA, layers=None)
NOT_MODULES = replace(MLP, layers=lambda config, seed: [1, 2])
'''


def test_a_users_sequential_is_measured_and_a_spec_without_layers_is_refused(capsys, tmp_path, monkeypatch):
    (tmp_path / "pipec_test_profile_specs.py").write_text(textwrap.dedent(SPECS))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "mlp.json"
    status, out, err = run(capsys, "profile", "--model", "pipec_test_profile_specs:MLP", "--repeats", "2",
                           "-o", str(path))
    assert status == 0, err
    layers = load_costs(str(path)).layers
    assert [layer.name for layer in layers] == ["0", "1", "2"]  # the model's own names, as training keeps them
    assert [layer.activation for layer in layers] == [3 * 16 * 4, 3 * 16 * 4, 3 * 4 * 4]
    assert [layer.parameters for layer in layers] == [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]
    for spec, message in [("NO_LAYERS", "has no layers(config, seed) function"),
                          ("NOT_MODULES", "layers(config, seed): layer 0 is a int, not an nn.Module")]:
        status, out, err = run(capsys, "profile", "--model", f"pipec_test_profile_specs:{spec}", "--repeats", "1")
        assert status == 1 and out == "" and message in err and err.count("\n") == 1, err
