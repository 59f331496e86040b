"""The model the runtime trains in demos and tests, and the interface for a user's own.

``LLAMA`` is the built-in ``ModelSpec``: a small LLaMA-style decoder (rotary
causal attention, SwiGLU MLP, RMSNorm; docs/runtime.md, "The built-in model")
that a pipeline cuts into ``num_chunks`` chunks of consecutive layers
(``chunk_layers``; chunk 0 also holds the embedding, the last chunk the final
norm and the head), trained on a synthetic task (``synthetic_batch``).

Two properties make a pipelined run comparable with one process, bit for bit
where the arithmetic is the same: parameter names inside a chunk are the full
model's (``layers.5.attn.wqkv.weight``), so the chunks' ``state_dict()``s
merge into the full model's; and every parameter is drawn from a generator
seeded by ``(seed, owner)`` (``stream_seed``; the owner is the layer index, or
the embedding, or the head), never from torch's global generator, so a chunk
built alone equals the same layers of the full model and building a model
leaves the caller's random state untouched.

``ModelSpec`` bundles the functions the runtime calls;
``load_model_spec("package.module:attribute")`` loads a user's (docs/runtime.md,
"Your own model"). A spec builds its chunks itself (``build_chunk`` and
``build_model``) or gives its layers in order (``layers``, which
``runtime/layered.py`` cuts), and feeds training from exactly one data source
(``synthetic_batch``, a ``microbatch`` function or a ``dataset``), from which
``runtime/data.py`` draws every batch.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pipec.errors import UsageError
from pipec.runtime import config as run_config
from pipec.runtime.layered import LayeredChunks, LayeredModel
from pipec.runtime.user_code import failure_words, is_interrupt

if TYPE_CHECKING:  # for annotations only: payload and precision are imported where they are used
    from pipec.runtime.payload import Layout
    from pipec.runtime.precision import Precision

# An attention a caller injects: (q, k, v) -> out, each [batch, heads, seq, head_dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the decoder and of one microbatch.

    Attributes:
        vocab: number of token ids (also the number of classes of the head).
        dim: width of the residual stream.
        layers: number of decoder layers; a pipeline's chunk count must divide it.
        heads: attention heads; ``dim / heads`` must be even (rotary pairs).
        hidden: width of the SwiGLU MLP.
        seq_len: tokens per sequence.
        microbatch_size: sequences per microbatch.
    """

    vocab: int = 64
    dim: int = 32
    layers: int = 8
    heads: int = 4
    hidden: int = 64
    seq_len: int = 16
    microbatch_size: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "layers", "heads", "hidden", "seq_len", "microbatch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"model config: {name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise UsageError(
                f"model config: dim {self.dim} must split into {self.heads} heads of an even width (rotary pairs)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# ------------------------------------------------------------------- seeding

# Owners of parameters other than decoder layers: their own generator streams,
# far from any layer index so that no model size makes two owners collide.
_EMBED_OWNER = 1 << 40
_HEAD_OWNER = (1 << 40) + 1
# Streams of the synthetic data, apart from every parameter stream.
_DATA_DOMAIN = 1 << 41
_TASK_DOMAIN = (1 << 41) + 1
_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, owner: int) -> int:
    """A generator seed for ``owner``'s random numbers under the run's ``seed``.

    SplitMix64's finaliser over the pair, so that neighbouring seeds and owners
    give unrelated streams; pure integer arithmetic, the same in every process
    (Python's ``hash`` is not, for strings).

    Args:
        seed: the run's seed (any int).
        owner: a layer index, or one of the owner/domain constants above plus an index.
    Returns:
        an int in [0, 2**63) for ``torch.Generator.manual_seed``.
    """
    z = (seed * 0x9E3779B97F4A7C15 + owner * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _generator(seed: int, owner: int) -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(seed, owner))


# ------------------------------------------------------------------- modules


def _linear(fan_in: int, fan_out: int) -> nn.Linear:
    # skip_init: no draw from torch's global generator; _initialise fills it.
    return torch.nn.utils.skip_init(nn.Linear, fan_in, fan_out, bias=False)


def rotary_table(seq_len: int, head_dim: int) -> torch.Tensor:
    """Rotations applied to a layer's stacked (query, key, value) projections.

    Feature pair (2i, 2i+1) of a query or key head at position p turns by the
    angle ``p * 10000 ** (-2i / head_dim)`` (LLaMA's interleaved-pair rotary
    convention); values turn by 0. Rotating all three in one complex product
    costs fewer kernel calls, forward and backward, than slicing out q and k
    first, and kernel calls are what a model this small costs.

    Returns:
        complex64 [seq_len, 3, 1, head_dim / 2]: (position, q/k/v, broadcast over
        heads, pair); computed in float64 and rounded once.
    """
    inverse_frequency = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inverse_frequency)
    no_turn = torch.zeros_like(angles)
    angles = torch.stack((angles, angles, no_turn), dim=1).unsqueeze(2)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rotary(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Turn the feature pairs of ``x`` [..., head_dim] by the unit complex numbers ``rotation`` [..., head_dim / 2]."""
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, written out: on CPU at this size it is cheaper
    than ``nn.RMSNorm``, whose fused path copies its input first."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings.

    ``wqkv`` holds the query, key and value projections stacked (rows 0..dim-1
    are W_q, then W_k, then W_v): one matrix product instead of three, which
    matters at this size where every kernel call costs more than its arithmetic.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.heads
        self.wqkv = _linear(config.dim, 3 * config.dim)
        self.wo = _linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, attend: Attend | None = None) -> torch.Tensor:
        """x: [batch * seq, dim], sequences one after another; rotation: ``rotary_table``'s rows of their
        positions (the first ``seq`` rows for whole sequences).

        ``attend``: None, causal ``scaled_dot_product_attention`` over the
        ``seq`` tokens given; else a function (q, k, v) -> out on
        [batch, heads, seq, head_dim] tensors that does the attention (a
        sequence ring's, whose tokens are a part of the sequence:
        ``runtime/sequence.py``).
        """
        tokens, dim = x.shape
        seq = rotation.shape[0]
        qkv = self.wqkv(x).view(tokens // seq, seq, 3, self.heads, dim // self.heads)
        # [batch, seq, 3, heads, head_dim] -> three of [batch, heads, seq, head_dim]
        q, k, v = apply_rotary(qkv, rotation).permute(2, 0, 3, 1, 4).unbind(0)
        if attend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(tokens, dim))


class SwiGLU(nn.Module):
    """``w2(silu(gate) * up)`` with ``w13`` holding the gate (W_1) and up (W_3) projections stacked."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w13 = _linear(config.dim, 2 * config.hidden)
        self.w2 = _linear(config.hidden, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, attend: Attend | None = None) -> torch.Tensor:
        """x: [batch * seq, dim] -> the same shape; ``attend`` as ``Attention.forward``'s."""
        x = x + self.attn(self.attn_norm(x), rotation, attend)
        return x + self.mlp(self.mlp_norm(x))


class DecoderChunk(nn.Module):
    """Consecutive decoder layers, plus the embedding if first and the head if last.

    The whole model is the chunk that is both first and last. Layers live in a
    ``ModuleDict`` keyed by their global index, so the names are the full model's.
    Inside, activations are [batch * seq, dim]: a linear layer on a 2-D input is
    one matrix product, where a 3-D input adds a reshape before and after, and
    at this size the autograd nodes cost more than the arithmetic.

    forward(x): token ids LongTensor [b, seq] when ``is_first``, else hidden states
    float [b, seq, dim]; returns logits [b, seq, vocab] when ``is_last``, else
    hidden states [b, seq, dim].

    forward(x, positions, attend): the same on a part of each sequence (a
    sequence ring's rank, ``runtime/sequence.py``): ``x`` holds the tokens at
    ``positions`` (LongTensor [seq], global positions < ``config.seq_len``, in
    the order of ``x``'s columns), rotary embeddings turn each by its global
    position, and every layer's attention is ``attend(q, k, v)`` (see
    ``Attention.forward``) instead of causal attention over the tokens given.
    Without them (the default) nothing changes.
    """

    def __init__(self, config: ModelConfig, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.config = config
        self.layer_range = layers
        self.is_first = is_first
        self.is_last = is_last
        if is_first:
            self.embed = torch.nn.utils.skip_init(nn.Embedding, config.vocab, config.dim)
        self.layers = nn.ModuleDict({str(index): DecoderLayer(config) for index in layers})
        if is_last:
            self.norm = RMSNorm(config.dim)
            self.head = _linear(config.dim, config.vocab)
        # Not persistent: derived from the config, so not part of the state_dict
        # a pipelined run saves (its keys must be the parameters only).
        self.register_buffer("rotary", rotary_table(config.seq_len, config.head_dim), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                attend: Attend | None = None) -> torch.Tensor:
        batch, seq = x.shape[:2]
        x = self.embed(x.reshape(-1)) if self.is_first else x.reshape(batch * seq, -1)
        if positions is None:
            rotation = self.rotary[:seq]
        else:
            if tuple(positions.shape) != (seq,):
                raise ValueError(f"positions must be one per token of a sequence, ({seq},); "
                                 f"got {tuple(positions.shape)}")
            rotation = self.rotary[positions]
        for layer in self.layers.values():
            x = layer(x, rotation, attend)
        if self.is_last:
            x = self.head(self.norm(x))
        return x.view(batch, seq, -1)


# ------------------------------------------------------------ initialisation

# Standard deviation of each kind of weight, by the last two parts of its name
# (norm weights are ones and draw nothing). Output projections of a residual
# branch are scaled down with depth so that the residual stream keeps its size.
_INIT_STD: dict[str, Callable[[ModelConfig], float]] = {
    "embed.weight": lambda c: 1.0,
    "wqkv.weight": lambda c: c.dim ** -0.5,
    "wo.weight": lambda c: (c.dim * 2 * c.layers) ** -0.5,
    "w13.weight": lambda c: c.dim ** -0.5,
    "w2.weight": lambda c: (c.hidden * 2 * c.layers) ** -0.5,
    # Small, so that the first loss is close to ln(vocab): no confident wrong guesses.
    "head.weight": lambda c: 0.02,
}


def _owner(name: str) -> int:
    """The generator stream a parameter is drawn from: its layer, or the embedding's, or the head's."""
    top, _, rest = name.partition(".")
    if top == "layers":
        return int(rest.partition(".")[0])
    return _EMBED_OWNER if top == "embed" else _HEAD_OWNER


@torch.no_grad()
def _initialise(chunk: DecoderChunk, config: ModelConfig, seed: int) -> None:
    """Fill every parameter from its owner's stream, in registration order.

    A chunk registers an owner's parameters in the same order as the full
    model does, so each stream yields the same numbers for the same names.
    """
    generators: dict[int, torch.Generator] = {}
    for name, parameter in chunk.named_parameters():
        kind = ".".join(name.split(".")[-2:])
        if kind.endswith("norm.weight"):
            parameter.fill_(1.0)
            continue
        owner = _owner(name)
        if owner not in generators:
            generators[owner] = _generator(seed, owner)
        parameter.normal_(0.0, _INIT_STD[kind](config), generator=generators[owner])


# ------------------------------------------------------------ public contract


def chunk_layers(config: ModelConfig, chunk: int, num_chunks: int) -> range:
    """The decoder layers of model chunk ``chunk`` out of ``num_chunks``.

    Args:
        config: the model.
        chunk: 0 .. num_chunks - 1, a stage's position along its pipeline.
        num_chunks: how many chunks the model is cut into; must divide ``config.layers``.
    Returns:
        a range of consecutive global layer indices, the same length for every chunk.
    Raises:
        UsageError: the layers do not split evenly, or ``chunk`` is out of range.
    """
    if num_chunks < 1 or config.layers % num_chunks:
        raise UsageError(
            f"the model has {config.layers} layers, which do not split evenly into {num_chunks} chunks; "
            f"choose a layer count that {num_chunks} divides"
        )
    if not 0 <= chunk < num_chunks:
        raise UsageError(f"chunk {chunk} is out of range: the model is cut into {num_chunks} chunks")
    per_chunk = config.layers // num_chunks
    return range(chunk * per_chunk, (chunk + 1) * per_chunk)


def build_chunk(config: ModelConfig, chunk: int, num_chunks: int, seed: int) -> DecoderChunk:
    """Model chunk ``chunk`` of ``num_chunks``, on the CPU in fp32 (``.to(device)`` it after).

    Args:
        config: the model.
        chunk: which chunk; chunk 0 holds the embedding, the last one the final norm and head.
        num_chunks: how many chunks the model is cut into.
        seed: the run's seed; equal seeds give equal parameters whatever the cut.
    Returns:
        a ``DecoderChunk`` whose parameters equal, name for name and bit for bit,
        those of ``build_model(config, seed)``.
    """
    layers = chunk_layers(config, chunk, num_chunks)
    module = DecoderChunk(config, layers, is_first=chunk == 0, is_last=chunk == num_chunks - 1)
    _initialise(module, config, seed)
    return module


def build_model(config: ModelConfig, seed: int) -> DecoderChunk:
    """The whole model: one chunk holding every layer, the embedding and the head."""
    return build_chunk(config, 0, 1, seed)


def llama_layers(config: ModelConfig, seed: int) -> nn.Sequential:
    """The whole model as its layers in order: the embedding, each decoder layer, the final norm and head.

    Each layer is a ``DecoderChunk`` of its own (the embedding alone, one decoder layer, the
    norm and head alone), so it takes and gives what a chunk boundary carries (hidden states
    [b, seq, dim]; token ids in, logits out at the ends) and its parameters are those of
    ``build_model(config, seed)``, name for name (``embed.weight``, ``layers.3...``,
    ``norm.weight``, ``head.weight``) and bit for bit: the layers' ``state_dict()``s merge into
    the model's, and running them in turn computes the model's forward.

    Returns:
        ``nn.Sequential`` of ``embed``, ``layer0`` .. ``layer{L-1}``, ``head``.
    """
    parts = [("embed", DecoderChunk(config, range(0), is_first=True, is_last=False))]
    parts += [(f"layer{index}", DecoderChunk(config, range(index, index + 1), is_first=False, is_last=False))
              for index in range(config.layers)]
    parts.append(("head", DecoderChunk(config, range(0), is_first=False, is_last=True)))
    for _, part in parts:
        _initialise(part, config, seed)
    return nn.Sequential(OrderedDict(parts))


def task_permutation(config: ModelConfig, seed: int) -> torch.Tensor:
    """The fixed vocabulary permutation of the synthetic task (LongTensor [vocab])."""
    return torch.randperm(config.vocab, generator=_generator(seed, _TASK_DOMAIN))


def synthetic_batch(
    config: ModelConfig, step: int, num_microbatches: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: uniform random tokens and their targets.

    The target of token t is ``perm[x[t]]`` (``task_permutation``). The
    data depend only on (config, step, num_microbatches, seed), so every worker
    draws the same batch without communicating. The loss starts at ln(vocab)
    and falls within a few steps, so a demo's first lines already show it
    learning. (A task that needs attention, such as predicting
    ``perm[x[t-1]]``, takes hundreds of steps at this size; attention and
    rotary embeddings still take part in every forward and backward, which is
    what the exactness tests need of them.)

    Args:
        config: the model (vocab, seq_len, microbatch_size).
        step: the training step (any int).
        num_microbatches: N; the batch has N * microbatch_size sequences.
        seed: the run's seed.
    Returns:
        (inputs, targets): LongTensors [N * microbatch_size, seq_len]; microbatch
        m is rows ``m * microbatch_size`` to ``(m + 1) * microbatch_size``.
    """
    generator = _generator(seed, _DATA_DOMAIN + step)
    inputs = torch.randint(
        config.vocab, (num_microbatches * config.microbatch_size, config.seq_len), generator=generator
    )
    return inputs, task_permutation(config, seed)[inputs]


def split_microbatches(batch: tuple[torch.Tensor, torch.Tensor], num_microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch from ``synthetic_batch`` into its N (inputs, targets) microbatches, in order."""
    inputs, targets = batch
    return list(zip(inputs.chunk(num_microbatches), targets.chunk(num_microbatches)))


def activation_shape(config: ModelConfig) -> tuple[int, int, int]:
    """Shape of what one chunk hands the next for one microbatch: (microbatch_size, seq_len, dim), fp32."""
    return (config.microbatch_size, config.seq_len, config.dim)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a microbatch (a scalar)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, learning rate 0.2, fp32.

    SGD rather than Adam because its update is linear in the gradient: the
    pipelined run sums microbatch gradients in another order than one process,
    and a rounding difference must stay a rounding difference (Adam divides by
    the gradient's size, which amplifies it wherever a gradient is near zero).
    ``foreach=False``: the same per-parameter arithmetic on every device (torch
    would pick the multi-tensor path on CUDA only).
    """
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, foreach=False)


def count_parameters(module: nn.Module) -> int:
    """Number of scalar parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())


def describe(config: ModelConfig, task: str = "map each token through a fixed permutation") -> str:
    """One line about the model for the demo: sizes, parameter count, microbatch shape, task.

    Args:
        config: the model.
        task: what it is trained to do (a spec that trains it on other data says so).
    """
    model_parameters = _parameter_count(config)
    return (
        f"LLaMA-style decoder: {config.layers} layers, dim {config.dim}, {config.heads} heads, "
        f"SwiGLU hidden {config.hidden}, vocab {config.vocab}, {model_parameters:,} parameters; "
        f"microbatch {config.microbatch_size} x {config.seq_len} tokens; task: {task}"
    )


def _parameter_count(config: ModelConfig) -> int:
    """Parameters of the whole model, by formula (describe() builds nothing)."""
    per_layer = 4 * config.dim * config.dim + 3 * config.dim * config.hidden + 2 * config.dim
    return config.layers * per_layer + 2 * config.vocab * config.dim + config.dim


# ----------------------------------------------------------- the model spec

# How a spec builds its model: both of these, or ``layers`` (from which both are derived).
_BUILDERS = ("build_chunk", "build_model")
# The functions every model spec has.
_TRAINING_FUNCTIONS = ("loss_fn", "make_optimizer")
_NEEDS_TEXT = ("build_chunk and build_model (or layers, from which pipec derives both), loss_fn and "
               "make_optimizer")
# Where a spec's training data come from: it has exactly one of these.
DATA_SOURCES = ("synthetic_batch", "microbatch", "dataset")
# Options of a dataset source only.
_DATASET_OPTIONS = ("microbatch_rows", "sampler")
_OPTIONAL_FUNCTIONS = ("describe", "activation_shape", "ring_model", *_DATASET_OPTIONS)
_SOURCES_TEXT = "synthetic_batch, microbatch or dataset"


class RingModel(NamedTuple):
    """What a model spec declares for sequence-ring training (``ModelSpec.ring_model``).

    Declaring it says the model's forward takes ``positions=`` (LongTensor [tokens], the
    global positions of the tokens given, in the order of dimension 1 of its input) and
    ``attend=`` (a function ``attend(q, k, v) -> out`` it calls for every attention, each
    (batch, heads, tokens, head dim), in the same order on every call), that its inputs'
    and targets' dimension 1 is the sequence, and that ``loss_fn`` is a mean over tokens
    (``runtime/sequence.py``; docs/runtime.md, "Training with a sequence ring").

    Attributes:
        seq_len: the sequence length of its batches (the ring's chunks and pieces must cut it).
        causal: whether its attention is causal (the ring's mask must be the same).
    """

    seq_len: int
    causal: bool


def ring_model(config: ModelConfig) -> RingModel:
    """The built-in model's declaration for sequence rings: causal attention over ``config.seq_len`` tokens."""
    return RingModel(config.seq_len, True)


@dataclass(frozen=True)
class ModelSpec:
    """The functions the runtime calls to build, feed and train a model.

    ``config`` is passed as the first argument of every function that takes
    one; the runtime never looks inside it. The first five fields keep their
    places (``ModelSpec(build_chunk, build_model, synthetic_batch, loss_fn,
    make_optimizer, config=...)``). Required: ``loss_fn``,
    ``make_optimizer``, exactly one data source, and either ``build_chunk``
    and ``build_model`` or ``layers``. Given ``layers`` alone, the spec
    derives the other two from it (``runtime.layered.LayeredChunks``, an
    even cut, and ``LayeredModel``), and they are its fields from then on;
    given all three, its own ``build_chunk`` and ``build_model`` run the
    model, and ``layers`` is there for whoever needs the layers (the profiler).

    Attributes:
        build_chunk: (config, chunk, num_chunks, seed) -> nn.Module of that chunk.
        build_model: (config, seed) -> the whole model, same parameter names.
        synthetic_batch: a data source: (config, step, num_microbatches, seed) ->
            (inputs, targets), the whole batch of ``step``, each with N equal
            blocks of rows (microbatch m is the m-th); every rank draws it.
        loss_fn: (last chunk's output, targets of the microbatch) -> scalar loss.
        make_optimizer: (iterable of parameters) -> torch.optim.Optimizer.
        config: whatever the functions above want as their config.
        describe: optional (config) -> one line for the demo.
        activation_shape: optional (config) -> shape of the fp32 tensor one chunk
            hands the next per microbatch (receivers allocate it before it
            arrives); without it the runtime assumes (config.microbatch_size,
            config.seq_len, config.dim).
        microbatch: a data source: (config, step, microbatch, num_microbatches,
            seed) -> (inputs, targets) of that one microbatch; called only on
            the ranks that need that microbatch's inputs or targets.
        dataset: a data source: (config, seed) -> a map-style
            ``torch.utils.data.Dataset`` whose item i is one row (inputs,
            targets) of tensors; a microbatch stacks ``microbatch_rows``
            consecutive rows of the stream the sampler orders.
        microbatch_rows: optional, dataset only: (config) -> rows per
            microbatch; default ``config.microbatch_size``.
        sampler: optional, dataset only: (config, dataset, seed) -> a
            ``torch.utils.data.Sampler`` of indices; default the runtime's
            seeded shuffle per epoch (``runtime/data.py``).
        layers: (config, seed) -> the model's layers in order, an
            ``nn.Sequential`` or a sequence of ``nn.Module``, built on the CPU
            with torch's global generator seeded with ``seed``
            (``runtime/layered.py``).
        ring_model: optional (config) -> ``RingModel``: the model can train with a
            sequence ring (its forward takes ``positions=`` and ``attend=``; see ``RingModel``).
    Raises:
        UsageError: a required function missing or not callable (one of
            build_chunk and build_model without the other, with or without
            layers), no data source or more than one (naming them), a dataset
            option without a dataset, or an optional function that is not callable.
    """

    build_chunk: Callable[..., nn.Module] | None = None
    build_model: Callable[..., nn.Module] | None = None
    synthetic_batch: Callable[..., tuple[Any, Any]] | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    make_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    config: Any = None
    describe: Callable[[Any], str] | None = None
    activation_shape: Callable[[Any], tuple[int, ...]] | None = None
    microbatch: Callable[..., tuple[Any, Any]] | None = None
    dataset: Callable[..., Any] | None = None
    microbatch_rows: Callable[[Any], int] | None = None
    sampler: Callable[..., Any] | None = None
    layers: Callable[..., Any] | None = None
    ring_model: Callable[[Any], RingModel] | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and not callable(self.layers):
            raise UsageError(f"the model spec's layers is a {type(self.layers).__name__}, not a function")
        if self.layers is not None and self.build_chunk is None and self.build_model is None:
            # derived once, here: every caller of build_chunk and build_model finds them as for any spec
            object.__setattr__(self, "build_chunk", LayeredChunks(self.layers))
            object.__setattr__(self, "build_model", LayeredModel(self.layers))
        missing = _missing_functions(lambda name: callable(getattr(self, name)))
        if missing:
            raise UsageError(f"a model spec needs {_NEEDS_TEXT}: missing or not callable: {', '.join(missing)}")
        sources = [name for name in DATA_SOURCES if getattr(self, name) is not None]
        if not sources:
            raise UsageError(f"a model spec needs one data source, {_SOURCES_TEXT}, and this one has none "
                             "(see docs/runtime.md, \"Model interface\")")
        if len(sources) > 1:
            raise UsageError(f"a model spec has exactly one data source, and this one has {len(sources)}: "
                             f"{' and '.join(sources)} (keep one)")
        for name in (*sources, *_OPTIONAL_FUNCTIONS):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise UsageError(f"the model spec's {name} is a {type(value).__name__}, not a function")
        stray = [name for name in _DATASET_OPTIONS if getattr(self, name) is not None]
        if stray and self.dataset is None:
            verb = "applies" if len(stray) == 1 else "apply"
            raise UsageError(f"the model spec's {' and '.join(stray)} only {verb} to a dataset, and its data "
                             f"come from {sources[0]}")

    @property
    def derives_chunks(self) -> bool:
        """Whether pipec cuts this spec's ``layers`` into chunks (it gave no ``build_chunk`` of its own)."""
        return isinstance(self.build_chunk, LayeredChunks)

    @property
    def data_source(self) -> str:
        """The name of the spec's one data source: ``synthetic_batch``, ``microbatch`` or ``dataset``."""
        return next(name for name in DATA_SOURCES if getattr(self, name) is not None)

    def summary(self) -> str:
        """One line for the demo: ``describe(config)``, or the functions' module."""
        if self.describe is not None:
            return self.describe(self.config)
        maker = self.layers if self.derives_chunks else self.build_chunk
        return f"model from {getattr(maker, '__module__', '?')}"


def _missing_functions(has: Callable[[str], bool]) -> list[str]:
    """What a spec lacks of its required functions, as ``ModelSpec``'s and ``load_model_spec``'s messages say it.

    Args:
        has: name -> whether the spec has that function (callable).
    Returns:
        the missing ones in order: ``build_chunk and build_model (or layers)``
        when it has neither nor ``layers``; one of the two with a word that
        they come together; ``loss_fn``, ``make_optimizer``.
    """
    builders = [name for name in _BUILDERS if not has(name)]
    missing = []
    if len(builders) == len(_BUILDERS) and not has("layers"):
        missing.append(" and ".join(_BUILDERS) + " (or layers)")
    elif len(builders) == 1:
        missing.append(f"{builders[0]} (a spec gives build_chunk and build_model together, or neither and layers)")
    return missing + [name for name in _TRAINING_FUNCTIONS if not has(name)]


LLAMA = ModelSpec(
    build_chunk=build_chunk,
    build_model=build_model,
    synthetic_batch=synthetic_batch,
    loss_fn=loss_fn,
    make_optimizer=make_optimizer,
    config=ModelConfig(),
    describe=describe,
    activation_shape=activation_shape,
    layers=llama_layers,
    ring_model=ring_model,
)
"""The built-in model: the default of ``--model``."""

LLAMA_LAYERS = dataclasses.replace(LLAMA, build_chunk=None, build_model=None)
"""The built-in model given by its layers only (``llama_layers``), so that pipec cuts it: evenly, or as a
``pipec partition`` file says (``pipec run --partition``). Its layers are ``LLAMA``'s, bit for bit
(``llama_layers``)."""

DEFAULT_MODEL = run_config.DEFAULT_MODEL
"""``--model``'s default, ``pipec.runtime.model:LLAMA`` (kept in ``runtime.config``, which loads no torch)."""


def load_model_spec(text: str) -> ModelSpec:
    """The model spec that ``--model TEXT`` names.

    Args:
        text: ``package.module:attribute`` (an attribute holding a ``ModelSpec``, or
            any object with ``build_chunk`` and ``build_model`` or ``layers``
            (or all three), ``loss_fn``, ``make_optimizer`` and one data source,
            and optionally ``config``, ``describe``, ``activation_shape`` and, with
            a dataset, ``microbatch_rows`` and ``sampler``), or ``package.module``
            (the module itself has them).
    Returns:
        a ``ModelSpec``.
    Raises:
        UsageError: malformed text, a module that cannot be imported (with the
            import's own error), a missing attribute, a missing or
            non-callable function, no data source or more than one.
    """
    module_name, _, attribute = text.partition(":")
    if not module_name or (":" in text and not attribute):
        raise UsageError(f"--model expects package.module:attribute, got {text!r}")
    module = _import_spec_module(module_name, text)
    target: Any = module
    for part in attribute.split(".") if attribute else ():
        if not hasattr(target, part):
            raise UsageError(f"--model {text}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if isinstance(target, ModelSpec):
        return target
    # only functions count: a module may hold other things under these names
    found = {name: getattr(target, name) for name in (*_BUILDERS, "layers", *_TRAINING_FUNCTIONS, *DATA_SOURCES,
                                                       *_OPTIONAL_FUNCTIONS)
             if callable(getattr(target, name, None))}
    missing = _missing_functions(found.__contains__)
    if not any(name in found for name in DATA_SOURCES):
        missing.append(f"a data source ({_SOURCES_TEXT})")
    if missing:
        raise UsageError(
            f"--model {text}: not a model spec: missing or not callable: {', '.join(missing)} "
            f"(a model spec has {_NEEDS_TEXT} and one data source, {_SOURCES_TEXT}; see docs/runtime.md)"
        )
    try:
        return ModelSpec(config=getattr(target, "config", None), **found)
    except UsageError as error:
        raise UsageError(f"--model {text}: {error}") from None


def _import_spec_module(module_name: str, text: str):
    """Import ``--model``'s module as a torchrun script's import would find it: the current directory
    first, then the installed packages.

    ``python -m`` (every worker) puts the current directory first on
    ``sys.path``; the ``pipec`` command, a console script, does not, so a
    ``mymodel.py`` beside the user would be found by the workers but not by
    the launcher's check. The directory is put first here, once.

    Raises:
        UsageError: the import failed (with its own error; where the module was not found, where it was looked for).
    """
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except BaseException as error:  # a user's module may fail in any way while importing, sys.exit(0) too
        if is_interrupt(error):
            raise
        hint = ""
        if isinstance(error, ModuleNotFoundError) and error.name == module_name.split(".")[0]:
            hint = (f" (looked in the current directory, {here}, and the installed packages: run pipec from the "
                    f"folder holding {error.name}.py, or add that folder to PYTHONPATH)")
        raise UsageError(f"--model {text}: cannot import module {module_name!r}: {failure_words(error)}"
                         f"{hint}") from None


def call_spec_function(name: str, what: str, function: Callable, *arguments: Any) -> Any:
    """Call one of a model spec's functions; its failure is a usage error that names the spec.

    Args:
        name: how to name the spec (``--model``'s text); "" for none.
        what: the call, as the message shows it (``"dataset(config, seed)"``).
        function: the spec's function.
        arguments: its arguments.
    Returns:
        what it returns.
    Raises:
        UsageError: ``model spec NAME: ...``: the function's own UsageError's
            words, or ``WHAT failed: TYPE: MESSAGE`` for any other exception.
    """
    try:
        return function(*arguments)
    except UsageError as error:
        raise UsageError(f"{spec_label(name)}: {error}") from None
    except BaseException as error:  # a user's function may fail in any way, sys.exit(0) and BaseException too
        if is_interrupt(error):
            raise
        raise UsageError(f"{spec_label(name)}: {what} failed: {failure_words(error)}") from None


def spec_optimizer(name: str, make_optimizer: Callable, parameters: list) -> torch.optim.Optimizer:
    """The spec's ``make_optimizer(parameters)``, checked to be an optimizer.

    Raises:
        UsageError: ``model spec NAME: ...``: the factory failed (``call_spec_function``), returned
            something other than a ``torch.optim.Optimizer`` (None included: the run would train nothing).
    """
    optimizer = call_spec_function(name, "make_optimizer(parameters)", make_optimizer, parameters)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"{spec_label(name)}: make_optimizer(parameters) returned {type(optimizer).__name__}, "
                         "not a torch.optim.Optimizer")
    return optimizer


def spec_label(name: str) -> str:
    """How messages name a model spec: ``model spec NAME``, or ``model spec`` without a name."""
    return f"model spec {name}" if name else "model spec"


def check_model_cut(spec: ModelSpec, config: Any, num_chunks: int, num_microbatches: int, seed: int,
                    declared: Layout | None, name: str, precision: Precision | None = None,
                    passes_activations: bool = True, shares: int = 1) -> list[Layout] | None:
    """Check, before any worker joins, that the model cuts into ``num_chunks``, that its data source gives the
    first microbatch, and what each chunk hands the next; find that out when the spec does not declare it.

    Builds chunk 0, draws microbatch 0 of step 0 (inputs and targets) from the
    spec's data source as training will (``data.BatchSource``), and with more
    than one chunk (or under weight passing) runs chunk 0's forward on it
    (autograd on, in ``precision``). Its output must be a payload (a tensor, or
    a tuple or dict of tensors: ``runtime/payload.py``) and, when the spec
    declares one, fit ``declared``. Without a declaration the first
    microbatch runs on through chunks 1 .. num_chunks - 2, built one at a
    time, and each output's layout is recorded (which leaves carry a
    gradient: those that require one).

    Args:
        spec: the model spec.
        config: its config, overrides applied.
        num_chunks: the program's chunk count.
        num_microbatches: the microbatches of one step's batch
            (``data.batch_microbatches(program)``: 1 for a sequence ring).
        seed: the run's seed.
        declared: the spec's ``activation_shape(config)`` as a layout, or None.
        name: how to name the spec in messages (``--model``'s text).
        precision: the run's compute precision (None: fp32).
        passes_activations: False under weight passing, where nothing leaves
            its rank: chunk 0 is run and its output checked to be a payload only.
        shares: k, when the program's stages sit on groups of k ranks: the microbatch's inputs and targets
            must cut into k equal row shares (``data.rows_share``); the layouts are still the whole
            microbatch's (``share_layout`` cuts them).
    Returns:
        chunk position c -> the layout of chunk c's output, for c < num_chunks - 1
        (empty for one chunk); None when ``passes_activations`` is False.
    Raises:
        UsageError: ``model spec NAME: ...`` naming the function at fault: a
            ``build_chunk``, ``make_optimizer`` (or one that gives no optimizer) or data source that fails (its own UsageError's
            words kept, so a missing data file is named), data of the wrong
            form, a forward that fails, an output that is no payload, or one
            that does not fit the declaration.
    """
    from pipec.runtime import payload
    from pipec.runtime.data import BatchSource  # data.py imports this module
    from pipec.runtime.precision import FP32

    precision = precision or FP32
    chunk = call_spec_function(name, f"build_chunk(config, 0, {num_chunks}, seed)", spec.build_chunk,
                               config, 0, num_chunks, seed)
    trained = [p for p in chunk.parameters() if p.requires_grad]
    if trained:  # a factory that fails or gives no optimizer is refused here, not on every rank later
        spec_optimizer(name, spec.make_optimizer, trained)
    first = frozenset({0})
    inputs, _ = BatchSource(spec, config, seed, num_microbatches, (first, first), name=name).batch(0)
    if shares > 1:  # said here, before any worker joins, rather than on every member at its first step
        BatchSource(spec, config, seed, num_microbatches, (first, first), name=name, share=(0, shares)).batch(0)
    if num_chunks < 2 and passes_activations:
        return []
    value, layouts = inputs[0], []
    for position in range(num_chunks - 1 if passes_activations else 1):
        if position > 0:
            chunk = call_spec_function(name, f"build_chunk(config, {position}, {num_chunks}, seed)",
                                       spec.build_chunk, config, position, num_chunks, seed)
            value, _ = payload.input_leaves(layouts[-1], value)
        with torch.enable_grad(), precision.autocast("cpu"):
            output = call_spec_function(name, f"chunk {position}'s forward on the first microbatch",
                                        payload.call, chunk, value)
        try:
            layout = payload.layout_of(output, f"chunk {position}'s output")
        except UsageError as error:
            raise UsageError(f"{spec_label(name)}: {error}") from None
        if declared is not None and position == 0:
            if payload.mismatch(declared, output) is not None:
                raise UsageError(f"{spec_label(name)}: activation_shape {_layout_words(declared)} does not match "
                                 f"what chunk 0 outputs {_layout_words(layout)} for one microbatch (fix "
                                 f"activation_shape(config), or the config's sizes)")
            return [declared] * (num_chunks - 1)
        layouts.append(layout)
        value = payload.rebuild(layout, [t.detach() for t in payload.leaves_of(output)])
        del chunk, output
    return layouts if passes_activations else None


def _layout_words(layout) -> str:
    """A layout in an error: a lone fp32 tensor by its shape alone (``(4, 32)``), anything else in full."""
    from pipec.runtime import payload

    if layout.form == payload.TENSOR and layout.leaves[0].dtype == torch.float32:
        return str(tuple(layout.leaves[0].shape))
    return layout.text()
