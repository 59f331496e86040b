"""Several tensors between chunks: layouts, the wire, and training with a two-tensor interface.

A chunk may hand the next a tuple or a dict of tensors, each with its own
shape and dtype, some without gradient (``runtime/payload.py``). The layout is
declared by the spec or found by running the first microbatch; the wire packs
a payload into one message and unpacks it bit for bit; and a model whose
chunks hand over a hidden state and a bool mask (``tests/payload_model.py``)
trains under zbv (split backward, a V with local hand-offs) and 1f1b to the
one-process result.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import payload_model
from pipec.compiler.driver import compile_target
from pipec.errors import UsageError
from pipec.runtime import payload
from pipec.runtime.payload import TensorSpec, Wire
from pipec.runtime.precision import BF16
from pipec.runtime.reference import reference_run
from pipec.runtime.worker import check_plan_model
from runtime_util import assert_same_parameters, launch_batch

TESTS = str(Path(__file__).resolve().parent)
STEPS, SEED = 3, 5
CPU = torch.device("cpu")


# ------------------------------------------------------------------ layouts


def test_a_declared_layout_takes_a_shape_a_tensor_spec_a_tuple_or_a_dict():
    assert payload.declared_layout((2, 3)) == payload.tensor_layout((2, 3))
    pair = payload.declared_layout((TensorSpec((2, 3)), TensorSpec((2,), torch.bool)))
    assert pair.form == payload.TUPLE and [leaf.grad for leaf in pair.leaves] == [True, False]
    keyed = payload.declared_layout({"h": TensorSpec((4,), torch.bfloat16), "ids": TensorSpec((4,), torch.int64)})
    assert keyed.keys == ("h", "ids") and keyed.grad_leaves == (0,)
    assert payload.declared_layout(TensorSpec((1,), torch.float32, grad=False)).grad_leaves == ()


@pytest.mark.parametrize("declared, words", [
    ("hidden", "must give a shape"),
    ((TensorSpec((2,), torch.int64, grad=True),), "cannot carry a gradient"),
    ({}, "must give a shape"),
    ((2, "x"), "must give a shape"),
])
def test_a_broken_declaration_is_named(declared, words):
    with pytest.raises(UsageError, match=words):
        payload.declared_layout(declared)


def test_the_layout_of_an_output_records_which_leaves_need_a_gradient():
    hidden = torch.randn(2, 3, requires_grad=True) * 2
    mask = torch.ones(2, dtype=torch.bool)
    layout = payload.layout_of({"hidden": hidden, "mask": mask}, "it")
    assert layout.text() == "{hidden: (2, 3) float32, mask: (2,) bool (no gradient)}"
    assert payload.mismatch(layout, {"hidden": hidden.detach(), "mask": mask}) is None  # a no-grad forward fits
    assert "the receivers expect" in payload.mismatch(layout, (hidden, mask))
    assert "the receivers expect" in payload.mismatch(layout, {"hidden": hidden[:1], "mask": mask})
    with pytest.raises(UsageError, match="a tensor, a tuple of tensors or a dict of tensors"):
        payload.layout_of([hidden, "mask"], "chunk 0's output")


# ------------------------------------------------------------------ the wire


def _mixed():
    layout = payload.declared_layout((TensorSpec((3, 5)), TensorSpec((3,), torch.bool), TensorSpec((2, 2), torch.int64),
                                      TensorSpec((7,), torch.float64)))
    value = (torch.randn(3, 5), torch.tensor([True, False, True]), torch.arange(4).view(2, 2), torch.randn(7).double())
    return layout, value


def test_a_lone_tensor_travels_as_itself():
    wire = Wire(payload.tensor_layout((2, 4)), CPU)
    x = torch.randn(2, 4)
    assert wire.pack(x).data_ptr() == x.data_ptr()  # no copy
    assert wire.buffer().shape == (2, 4) and wire.buffer().dtype == torch.float32


def test_several_leaves_are_packed_into_one_buffer_and_unpacked_bit_for_bit():
    layout, value = _mixed()
    wire = Wire(layout, CPU)
    packed = wire.pack(value)
    assert packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() == wire.buffer().numel()
    received = wire.buffer()
    received.copy_(packed)  # what the message does
    for got, want in zip(wire.unpack(received), value):
        assert got.dtype == want.dtype and torch.equal(got, want)
    grads = [torch.randn(3, 5), torch.randn(7).double()]
    back = wire.grad_buffer()
    back.copy_(wire.pack_grads(grads))
    assert all(torch.equal(g, w) for g, w in zip(wire.unpack_grads(back), grads))


def test_under_bf16_floating_leaves_travel_in_bf16_and_a_local_hand_off_rounds_alike():
    layout, value = _mixed()
    fp32, bf16 = Wire(layout, CPU), Wire(layout, CPU, BF16.wire_dtype)
    assert bf16.buffer().numel() < fp32.buffer().numel()  # half the floating bytes (aligned)
    received = bf16.buffer()
    received.copy_(bf16.pack(value))
    arrived = bf16.unpack(received)
    rounded = bf16.hand_off(value)
    assert torch.equal(arrived[0], value[0].bfloat16().float()) and arrived[0].dtype == torch.float32
    assert torch.equal(arrived[1], value[1]) and torch.equal(arrived[2], value[2])  # bool and ints untouched
    assert all(torch.equal(a, r) for a, r in zip(arrived, rounded))
    assert not torch.equal(arrived[0], value[0])  # bf16 really rounded


# ------------------------------------------------------------------ finding layouts


def test_layouts_are_found_by_running_the_first_microbatch_through_the_chunks():
    spec = payload_model.PROBED
    program = compile_target("1f1b", {"P": 4, "N": 4}).program
    config = payload_model.Config(form="dict")
    layouts = check_plan_model(spec, config, program, SEED, "payload_model:PROBED")
    declared = payload.declared_layout(payload_model.activation_shape(config))
    assert layouts == [declared] * 3
    assert layouts[0].text() == "{hidden: (3, 5, 8) float32, mask: (3, 5) bool (no gradient)}"


def test_a_declaration_that_does_not_fit_chunk_0_is_named_before_launch():
    spec = replace(payload_model.SPEC, activation_shape=lambda config: (TensorSpec((3, 5, 8)), TensorSpec((3, 5))))
    program = compile_target("1f1b", {"P": 2, "N": 2}).program
    with pytest.raises(UsageError, match=r"model spec m: activation_shape \(\(3, 5, 8\) float32, \(3, 5\) float32\) "
                                         r"does not match what chunk 0 outputs \(\(3, 5, 8\) float32, \(3, 5\) bool "
                                         r"\(no gradient\)\)"):
        check_plan_model(spec, payload_model.Config(), program, SEED, "m")


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """zbv (tuple, declared; also with every stage recomputed) and 1f1b (dict, found) on 2 gloo ranks with
    the hidden-and-mask model."""
    folder = tmp_path_factory.mktemp("payloads")
    cases = {"zbv": ("SPEC", "tuple", []), "1f1b": ("PROBED", "dict", []),
             "zbv-remat": ("SPEC", "tuple", ["-D", "remat=true"])}
    jobs = [[name.split("-")[0], "-D", "P=2", "-D", "N=4", *extra, "--steps", str(STEPS), "--seed", str(SEED),
             "--model", f"payload_model:{model}", "--config", f"form={form}", "--save", str(folder / f"{name}.pt")]
            for name, (model, form, extra) in cases.items()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
        run = launch_batch(jobs, 2, 180.0)
    assert run.ok, run.describe()
    return folder, cases


@pytest.mark.parametrize("name", ["zbv", "1f1b", "zbv-remat"])
def test_a_hidden_state_and_a_mask_train_like_one_process(trained, name):
    folder, cases = trained
    model, form, _ = cases[name]
    spec = getattr(payload_model, model)
    want = reference_run(payload_model.Config(form=form), STEPS, 4, SEED, spec).state_dict
    got = torch.load(folder / f"{name}.pt", weights_only=True)
    assert_same_parameters(got, want, f"{name} with a (hidden, mask) {form}")
