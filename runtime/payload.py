"""What one model chunk hands the next: one tensor, or a tuple or a dict of tensors, and how it travels.

A chunk's output is its *payload*: a tensor, a tuple of tensors (the next
chunk is called with them as positional arguments) or a dict of tensors with
string keys (keyword arguments). Each tensor (a *leaf*) has its own shape and
dtype, and either carries a gradient back (a floating tensor that depends on
the parameters, the hidden state) or not (an attention mask, token ids). A
``Layout`` records that: what a receiver allocates before a message arrives,
and which leaves its backward sends gradients for. A spec declares it
(``activation_shape(config)``: a shape, a ``TensorSpec``, or a tuple or dict
of them), or the runtime finds it by running the first microbatch through the
chunks (``probe_layouts``); either way every output is checked against it.

On the wire a payload is one tensor, so that a program's one SEND matches one
RECV whatever the payload holds: a single leaf travels as itself; several
leaves, or leaves whose dtype changes on the wire, are packed into one byte
buffer (each leaf at an offset aligned for its dtype) and unpacked into views.
The gradients of the leaves that carry one travel back the same way. Under
mixed precision (``wire_dtype``, the compute dtype) floating leaves travel in
that dtype and are cast back to their own on arrival; a local hand-off rounds
the same way (``Wire.hand_off``), so a run's numbers do not depend on which
stages share a rank.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from pipec.errors import UsageError

TENSOR, TUPLE, DICT = "tensor", "tuple", "dict"
# Every leaf of a packed buffer starts at a multiple of this many bytes, so
# that a view of it as any dtype is aligned.
_ALIGN = 16


class TensorSpec(NamedTuple):
    """A declared leaf of a payload (for a spec's ``activation_shape(config)``).

    Attributes:
        shape: its shape for one microbatch.
        dtype: its dtype.
        grad: whether its gradient travels back; None: floating dtypes do.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    grad: bool | None = None


class Leaf(NamedTuple):
    """One tensor of a payload: its shape, dtype, and whether a gradient travels back for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool

    def text(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}" + ("" if self.grad else " (no gradient)")


class Layout(NamedTuple):
    """The structure of a payload: its form, its dict keys (in order) and its leaves."""

    form: str
    keys: tuple[str, ...]
    leaves: tuple[Leaf, ...]

    def text(self) -> str:
        """For messages: ``(2, 16, 32) float32`` or ``{hidden: ..., mask: ...}``."""
        if self.form == TENSOR:
            return self.leaves[0].text()
        if self.form == TUPLE:
            return "(" + ", ".join(leaf.text() for leaf in self.leaves) + ")"
        return "{" + ", ".join(f"{key}: {leaf.text()}" for key, leaf in zip(self.keys, self.leaves)) + "}"

    @property
    def grad_leaves(self) -> tuple[int, ...]:
        """The indices of the leaves whose gradients travel back."""
        return tuple(i for i, leaf in enumerate(self.leaves) if leaf.grad)


def tensor_layout(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Layout:
    """The layout of one tensor that carries a gradient (what activation passing handed over before payloads)."""
    return Layout(TENSOR, (), (Leaf(tuple(int(n) for n in shape), dtype, True),))



def share_layout(layout: Layout, shares: int, what: str) -> Layout:
    """``layout`` of a whole microbatch's value as one member of a group of ``shares`` holds it: every leaf's
    first dimension (the microbatch's rows) cut into ``shares`` equal pieces.

    Raises:
        UsageError: a leaf with no first dimension that divides by ``shares`` (its rows cannot be shared).
    """
    leaves = []
    for leaf in layout.leaves:
        if not leaf.shape or leaf.shape[0] % shares:
            raise UsageError(f"{what} {layout.text()} does not split by rows into the {shares} shares of a "
                             f"stage's group: every tensor it hands on needs the microbatch's rows first, a "
                             f"multiple of {shares}")
        leaves.append(leaf._replace(shape=(leaf.shape[0] // shares, *leaf.shape[1:])))
    return layout._replace(leaves=tuple(leaves))


def token_layout(layout: Layout, tokens: int, seq_len: int, what: str) -> Layout:
    """``layout`` of a whole microbatch's value as one member of a context-parallel group holds it: every
    leaf's dimension 1 (the sequence, ``seq_len`` long) cut to the member's ``tokens``.

    Raises:
        UsageError: a leaf whose dimension 1 is not the sequence (the member could not hand on its tokens).
    """
    for leaf in layout.leaves:
        if len(leaf.shape) < 2 or leaf.shape[1] != seq_len:
            raise UsageError(f"{what} {layout.text()} does not split by tokens over a stage's context-parallel "
                             f"group: every tensor it hands on needs the sequence ({seq_len} tokens) in dimension 1")
    return layout._replace(leaves=tuple(leaf._replace(shape=(leaf.shape[0], tokens, *leaf.shape[2:]))
                                        for leaf in layout.leaves))

# ------------------------------------------------------------- structures


def leaves_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a payload in layout order (dict values in insertion order)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return list(value.values())
    return list(value)


def rebuild(layout: Layout, tensors: Sequence[torch.Tensor]) -> Any:
    """A payload of ``layout``'s form from its leaves, in order."""
    if layout.form == TENSOR:
        return tensors[0]
    if layout.form == TUPLE:
        return tuple(tensors)
    return dict(zip(layout.keys, tensors))


def layout_of(value: Any, what: str) -> Layout:
    """The layout of an actual payload (a leaf carries a gradient when it requires one).

    Args:
        value: a chunk's output.
        what: how to name it in the error (``chunk 0's output``).
    Raises:
        UsageError: it is not a tensor, a tuple of tensors or a dict of tensors with string keys.
    """
    def leaf(tensor) -> Leaf:
        return Leaf(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad))

    if isinstance(value, torch.Tensor):
        return Layout(TENSOR, (), (leaf(value),))
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return Layout(TUPLE, (), tuple(leaf(t) for t in value))
    if (isinstance(value, dict) and value and all(isinstance(k, str) for k in value)
            and all(isinstance(t, torch.Tensor) for t in value.values())):
        return Layout(DICT, tuple(value), tuple(leaf(t) for t in value.values()))
    raise UsageError(f"{what} is a {type(value).__name__}: a chunk hands the next one a tensor, a tuple of "
                     "tensors or a dict of tensors with string keys")


def declared_layout(declared: Any, what: str = "activation_shape(config)") -> Layout:
    """The layout a spec declares: a shape (one fp32 tensor with a gradient), a ``TensorSpec``, or a
    non-empty tuple or dict of ``TensorSpec``.

    Raises:
        UsageError: anything else, naming ``what``.
    """
    def leaf(spec: TensorSpec) -> Leaf:
        try:
            shape = tuple(int(n) for n in spec.shape)
        except (TypeError, ValueError):
            raise UsageError(f"{what}: a TensorSpec's shape must be a tuple of ints, got {spec.shape!r}") from None
        if not isinstance(spec.dtype, torch.dtype) or any(n < 0 for n in shape):
            raise UsageError(f"{what}: {spec!r} needs a shape of non-negative ints and a torch dtype")
        grad = spec.dtype.is_floating_point if spec.grad is None else bool(spec.grad)
        if grad and not spec.dtype.is_floating_point:
            raise UsageError(f"{what}: a {spec.dtype} leaf cannot carry a gradient")
        return Leaf(shape, spec.dtype, grad)

    if isinstance(declared, TensorSpec):
        return Layout(TENSOR, (), (leaf(declared),))
    if isinstance(declared, dict) and declared and all(isinstance(k, str) and isinstance(v, TensorSpec)
                                                       for k, v in declared.items()):
        return Layout(DICT, tuple(declared), tuple(leaf(v) for v in declared.values()))
    if isinstance(declared, (tuple, list)) and declared:
        if all(isinstance(v, TensorSpec) for v in declared):
            return Layout(TUPLE, (), tuple(leaf(v) for v in declared))
        try:
            return tensor_layout(tuple(int(n) for n in declared))
        except (TypeError, ValueError):
            pass
    raise UsageError(f"{what} must give a shape (a tuple of ints), a TensorSpec, or a tuple or dict of "
                     f"TensorSpec (pipec.runtime.payload.TensorSpec); got {declared!r}")


def floating_layout(value: Any, what: str = "a chunk's output") -> Layout:
    """The layout of a payload whose floating leaves carry gradients (weight passing: its activations
    stay on their rank and its forwards run without autograd, so nothing says which leaves require one)."""
    layout = layout_of(value, what)
    return layout._replace(leaves=tuple(leaf._replace(grad=leaf.dtype.is_floating_point) for leaf in layout.leaves))


def arguments(value: Any) -> tuple[tuple, dict]:
    """A payload as a chunk's (positional, keyword) arguments: a dict's items are keywords, a tuple's
    leaves positional, a tensor the one argument."""
    if isinstance(value, dict):
        return (), value
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    return (value,), {}


def call(module: Callable, value: Any, **extra: Any) -> Any:
    """Run a chunk on a payload: ``module(x)``, ``module(*value)`` for a tuple, ``module(**value)`` for a dict;
    ``extra`` keywords besides (a context-parallel stage's ``positions=`` and ``attend=``)."""
    args, kwargs = arguments(value)
    return module(*args, **kwargs, **extra)


def mismatch(layout: Layout, value: Any) -> str | None:
    """Why ``value`` does not fit ``layout`` (its form, keys, shapes and dtypes), or None when it fits.

    Whether a leaf requires a gradient is not compared: a forward without
    autograd (a checkpointed one) makes none, and a leaf the layout says
    carries none has its gradient dropped.
    """
    try:
        actual = layout_of(value, "the output")
    except UsageError as error:
        return str(error)
    if actual.form != layout.form or actual.keys != layout.keys or len(actual.leaves) != len(layout.leaves):
        return f"it is {actual.text()}, the receivers expect {layout.text()}"
    for got, want in zip(actual.leaves, layout.leaves):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"it is {actual.text()}, the receivers expect {layout.text()}"
    return None


# ------------------------------------------------------------------ the wire


class Wire:
    """How one stage boundary's payload and its gradients travel as one tensor each.

    Args:
        layout: the payload's layout.
        device: where buffers live.
        wire_dtype: the dtype floating leaves travel in (mixed precision's
            compute dtype); None: their own.
    """

    def __init__(self, layout: Layout, device: torch.device, wire_dtype: torch.dtype | None = None):
        self.layout = layout
        self.device = device
        self.forward = _Packing([leaf for leaf in layout.leaves], wire_dtype)
        self.backward = _Packing([layout.leaves[i] for i in layout.grad_leaves], wire_dtype)

    # -- the payload, forward

    def pack(self, value: Any) -> torch.Tensor:
        """The one tensor that carries ``value`` (its leaves in the wire's dtypes)."""
        return self.forward.pack(leaves_of(value), self.device)

    def buffer(self) -> torch.Tensor:
        """A fresh receive buffer for one payload."""
        return self.forward.buffer(self.device)

    def unpack(self, buffer: torch.Tensor) -> Any:
        """The payload a received buffer holds, each leaf in its own dtype."""
        return rebuild(self.layout, self.forward.unpack(buffer))

    def hand_off(self, value: Any) -> Any:
        """What a stage on the same rank reads: ``value`` detached, rounded as a message would round it."""
        tensors = [t.detach() for t in leaves_of(value)]
        return rebuild(self.layout, self.forward.round(tensors))

    # -- its gradients, backward

    def pack_grads(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.backward.pack(list(grads), self.device)

    def grad_buffer(self) -> torch.Tensor:
        return self.backward.buffer(self.device)

    def unpack_grads(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return self.backward.unpack(buffer)

    def hand_off_grads(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.backward.round(list(grads))


class _Packing:
    """One direction of a wire: a list of leaves as one tensor (the leaf itself when it can be)."""

    def __init__(self, leaves: list[Leaf], wire_dtype: torch.dtype | None):
        self.leaves = leaves
        self.wire = [wire_dtype if wire_dtype is not None and leaf.dtype.is_floating_point else leaf.dtype
                     for leaf in leaves]
        # one leaf in its own dtype: it travels as itself, no copy
        self.direct = len(leaves) == 1 and self.wire[0] == leaves[0].dtype
        self.offsets, offset = [], 0
        for leaf, dtype in zip(leaves, self.wire):
            self.offsets.append(offset)
            size = _numel(leaf.shape) * dtype.itemsize
            offset += -(-size // _ALIGN) * _ALIGN
        self.nbytes = offset

    def pack(self, tensors: list[torch.Tensor], device) -> torch.Tensor:
        if self.direct:
            return tensors[0].detach().contiguous()
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for tensor, dtype, offset in zip(tensors, self.wire, self.offsets):
            count = tensor.numel()
            out[offset:offset + count * dtype.itemsize].view(dtype).copy_(tensor.detach().reshape(-1))
        return out

    def buffer(self, device) -> torch.Tensor:
        if self.direct:
            return torch.empty(self.leaves[0].shape, dtype=self.leaves[0].dtype, device=device)
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        if self.direct:
            return [buffer]
        out = []
        for leaf, dtype, offset in zip(self.leaves, self.wire, self.offsets):
            count = _numel(leaf.shape)
            view = buffer[offset:offset + count * dtype.itemsize].view(dtype).view(leaf.shape)
            out.append(view if dtype == leaf.dtype else view.to(leaf.dtype))
        return out

    def round(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves as they would arrive: cast to the wire's dtype and back where it differs."""
        return [t if dtype == t.dtype else t.to(dtype).to(t.dtype) for t, dtype in zip(tensors, self.wire)]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


# ------------------------------------------------------------ autograd glue


def input_leaves(layout: Layout, value: Any) -> tuple[Any, list[torch.Tensor]]:
    """A received payload made the input of a stage's graph: the leaves that carry a gradient become
    autograd leaves (detached, requiring grad). Returns (the payload, those leaves in layout order)."""
    tensors = leaves_of(value)
    grads = []
    for i in layout.grad_leaves:
        tensors[i] = tensors[i].detach().requires_grad_()
        grads.append(tensors[i])
    return rebuild(layout, tensors), grads


def backward_roots(layout: Layout, value: Any, grads: Sequence[torch.Tensor]) -> tuple[list, list]:
    """The leaves of a stage's output that the next stage sent gradients for, with those gradients;
    a leaf that depends on nothing trainable (it requires no gradient) is left out with its gradient."""
    tensors = leaves_of(value)
    roots, kept = [], []
    for i, grad in zip(layout.grad_leaves, grads):
        if tensors[i].requires_grad:
            roots.append(tensors[i])
            kept.append(grad)
    return roots, kept


def leaf_grads(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients autograd left on input leaves; zeros for a leaf the output does not depend on."""
    return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]


__all__ = [
    "DICT", "TENSOR", "TUPLE", "Layout", "Leaf", "TensorSpec", "Wire", "arguments", "backward_roots", "call",
    "declared_layout", "floating_layout", "input_leaves",
    "layout_of", "leaf_grads", "leaves_of", "mismatch", "rebuild", "share_layout", "tensor_layout", "token_layout",
]
