"""A model given by its layers in order, cut into a pipeline's chunks by pipec instead of by the user.

A model spec may give ``layers(config, seed)``, which returns the model's
layers in order (an ``nn.Sequential``, an ``nn.ModuleList``, or a list or
tuple of modules), instead of ``build_chunk`` and ``build_model``; the spec
then derives both from it (``LayeredChunks``, ``LayeredModel``; see
docs/runtime.md, "A model given by its layers"). What makes a pipelined run of
such a model equal one process:

* **Every process builds the same layers.** ``build_layers`` calls
  ``layers(config, seed)`` with torch's global CPU generator seeded with
  ``seed``, inside ``torch.random.fork_rng``: the default initialisation of
  ``nn.Linear`` and its kind draws from that generator, so every rank (and
  the one-process reference) gets the same numbers, and the caller's random
  state is the same after as before. The layers are built on the CPU (the
  runtime moves a chunk to its device); a CUDA generator is neither seeded
  nor restored.
* **Names are the whole model's.** A chunk is a ``LayerStack`` of its layers,
  each registered under its name in the whole model: its key in the
  ``nn.Sequential`` returned (``"3"``, or the name an ``OrderedDict`` gave
  it), else its index. So a chunk's parameters are ``"3.weight"`` as the
  whole model's are, and the chunks' state_dicts merge into the whole model's
  (``--save``, checkpoints).
* **The cut**: even, or as a partition file says (``LayeredChunks``).

A layer takes the layer before's output as its one argument, as in an
``nn.Sequential``; the first takes a microbatch's inputs. A tuple or dict a
layer returns crosses a chunk boundary as a payload (``runtime/payload.py``)
and reaches the next layer as the same tuple or dict (a tuple of one tensor
arrives as the tensor).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from pipec.errors import UsageError
from pipec.runtime.family import runtime_family

if TYPE_CHECKING:  # for annotations only
    from pipec.compiler.ir import Program
    from pipec.compiler.partition import Partition

# (first, stop) per chunk: layers first .. stop - 1.
Cut = tuple[tuple[int, int], ...]


class LayerStack(nn.Sequential):
    """Some consecutive layers of a model, registered under their names in the whole model.

    An ``nn.Sequential`` whose forward also takes what ``payload.call`` passes
    a chunk: one value, a tuple's tensors as positional arguments, or a dict's
    as keywords; it rebuilds the value and hands it to the first layer.
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]):
        super().__init__(OrderedDict(named_layers))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(_one_value(args, kwargs))


def _one_value(args: tuple, kwargs: dict) -> Any:
    """The value ``payload.call`` spread into arguments: a dict, a lone value, or a tuple."""
    if kwargs and args:
        raise TypeError("a model given by its layers takes one value: positional arguments (a tuple's tensors) "
                        "or keywords (a dict's), not both")
    if kwargs:
        return dict(kwargs)
    if len(args) == 1:
        return args[0]
    if not args:
        raise TypeError("a model given by its layers takes one value, and was called with none")
    return args


def build_layers(layers: Callable[..., Any], config: Any, seed: int) -> list[tuple[str, nn.Module]]:
    """The model's layers with their names, built as every process builds them.

    Args:
        layers: the spec's ``layers(config, seed)``.
        config: the spec's config.
        seed: the run's seed; torch's global CPU generator is seeded with it
            while ``layers`` runs, and restored after.
    Returns:
        (name, layer) in order: an ``nn.Sequential``'s own keys, else ``"0"``, ``"1"``, ...
    Raises:
        UsageError: ``layers(config, seed)`` fails (its own UsageError's words
            kept, any other exception named), returns something other than an
            ``nn.Sequential``, ``nn.ModuleList``, list or tuple of modules,
            returns no layers, or layers that share a parameter (tied weights:
            two chunks could not keep one tensor).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        try:
            built = layers(config, seed)
        except UsageError:
            raise
        except Exception as error:  # a user's function may fail in any way
            raise UsageError(f"layers(config, seed) failed: {type(error).__name__}: {error}") from None
    if isinstance(built, nn.Sequential):
        # its own registry: named_children() would hide a module given twice (nn.Tanh() reused is fine)
        named = list(built._modules.items())
    elif isinstance(built, (nn.ModuleList, list, tuple)):
        named = [(str(index), layer) for index, layer in enumerate(built)]
    else:
        raise UsageError(f"layers(config, seed) returned a {type(built).__name__}, not an nn.Sequential or a list "
                         "of the model's layers (nn.Module) in order")
    if not named:
        raise UsageError("layers(config, seed) returned no layers")
    owners: dict[int, str] = {}
    for name, layer in named:
        if not isinstance(layer, nn.Module):
            raise UsageError(f"layers(config, seed): layer {name} is a {type(layer).__name__}, not an nn.Module")
        for parameter in layer.parameters():
            owner = owners.setdefault(id(parameter), name)
            if owner != name:
                raise UsageError(f"layers(config, seed): layers {owner} and {name} share a parameter (tied "
                                 "weights), which chunks on different ranks cannot share; give each layer its own")
    return named


def even_cut(num_layers: int, num_chunks: int) -> Cut:
    """``num_layers`` layers cut into ``num_chunks`` consecutive runs, as evenly as they go.

    Returns:
        per chunk (first, stop); the first ``num_layers % num_chunks`` chunks
        hold one layer more than the others.
    Raises:
        UsageError: more chunks than layers (naming both).
    """
    if num_chunks > num_layers:
        raise UsageError(f"the model's {num_layers} layers cannot be cut into the program's {num_chunks} chunks: "
                         f"every chunk needs a layer (use a schedule with at most {num_layers} chunks, or a "
                         "model with more layers)")
    per, extra = divmod(num_layers, num_chunks)
    cut, first = [], 0
    for chunk in range(num_chunks):
        stop = first + per + (chunk < extra)
        cut.append((first, stop))
        first = stop
    return tuple(cut)


@dataclasses.dataclass(frozen=True)
class LayeredChunks:
    """The ``build_chunk`` a spec derives from ``layers``: (config, chunk, num_chunks, seed) -> ``LayerStack``.

    The cut: by default even (``even_cut``: L layers into C chunks, the
    first ``L % C`` chunks one layer more), or as a partition file says
    (``pipec run --partition FILE``: ``cut_by_partition``). Each rank builds
    every layer and keeps its chunk's, so each chunk a rank holds costs it one
    whole build on the CPU; the other layers are freed at once.

    Attributes:
        layers: the spec's ``layers(config, seed)``.
        cut: per chunk (first, stop), from a partition file; None: ``even_cut``.
        source: where ``cut`` comes from, for messages (``--partition part.json``).
    """

    layers: Callable[..., Any]
    cut: Cut | None = None
    source: str = ""

    def __call__(self, config: Any, chunk: int, num_chunks: int, seed: int) -> LayerStack:
        """Chunk ``chunk`` of ``num_chunks``: its layers of a whole build (``build_layers``), the rest freed.

        Raises:
            UsageError: ``build_layers``'s; more chunks than layers (even cut);
                a cut of another layer or chunk count; ``chunk`` out of range.
        """
        named = build_layers(self.layers, config, seed)
        cut = self.cut_for(len(named), num_chunks)
        if not 0 <= chunk < num_chunks:
            raise UsageError(f"chunk {chunk} is out of range: the model is cut into {num_chunks} chunks")
        first, stop = cut[chunk]
        return LayerStack(named[first:stop])

    def cut_for(self, num_layers: int, num_chunks: int) -> Cut:
        """The cut of a model of ``num_layers`` layers into ``num_chunks`` chunks: ``cut``, checked, or even."""
        if self.cut is None:
            return even_cut(num_layers, num_chunks)
        held = self.cut[-1][1]
        if held != num_layers:
            raise UsageError(f"{self.source} cuts a model of {held} layers, but layers(config, seed) gives "
                             f"{num_layers}: make the partition for this model and config")
        if len(self.cut) != num_chunks:
            raise UsageError(f"{self.source} has {len(self.cut)} stages, but the program cuts the model into "
                             f"{num_chunks} chunks")
        return self.cut


@dataclasses.dataclass(frozen=True)
class LayeredModel:
    """The ``build_model`` a spec derives from ``layers``: (config, seed) -> a ``LayerStack`` of every layer.

    Its state_dict is the one an ``nn.Sequential`` of the layers has, and the merge of the chunks'.
    """

    layers: Callable[..., Any]

    def __call__(self, config: Any, seed: int) -> LayerStack:
        return LayerStack(build_layers(self.layers, config, seed))


def cut_by_partition(spec, partition: Partition, path: str, program: Program, name: str):
    """``spec`` with its chunks cut as the partition file ``path`` says, checked against ``program``.

    The program's placement decides where each chunk runs and which
    microbatches each replica takes; the partition's ``ranks`` must agree
    with it, so that a partition made for another placement (its stage times
    and replicas assumed elsewhere) is named rather than run.

    Args:
        spec: the model spec ``--model`` names.
        partition: the partition file's content (``compiler.partition.load_partition``).
        path: the file, for messages.
        program: the compiled program.
        name: ``--model``'s text, for messages.
    Returns:
        a ``ModelSpec`` whose ``build_chunk`` is ``LayeredChunks`` with the partition's cut.
    Raises:
        UsageError: the spec builds its own chunks; a weight-passing or
            sequence-ring program; a stage count other than the program's
            chunk count or a rank count other than its ranks (both numbers
            named); a stage whose ranks are not where the program places
            its chunk.
    """
    if not spec.derives_chunks:
        raise UsageError(f"--partition {path} cuts a model given by its layers, and model spec {name} builds its own "
                         "chunks (build_chunk): leave --partition out, or give a spec with layers(config, seed) and "
                         "no build_chunk (the built-in model so: --model pipec.runtime.model:LLAMA_LAYERS)")
    family = runtime_family(program)
    if not family.takes_partition:
        raise UsageError(f"--partition {path} cuts a model into pipeline stages, and {program.name} is a "
                         f"{family.label} schedule, which has none to cut: leave --partition out")
    if len(partition.stages) != program.num_chunks:
        raise UsageError(f"--partition {path} has {len(partition.stages)} stages, but {program.name} cuts the model "
                         f"into {program.num_chunks} chunks: make the partition for this schedule")
    if partition.ranks != program.num_ranks:
        raise UsageError(f"--partition {path} was made for {partition.ranks} ranks, but {program.name} runs on "
                         f"{program.num_ranks}: make the partition for this schedule")
    for chunk, stage in enumerate(partition.stages):
        placed = sorted({program.stages[line[chunk]].rank for line in program.pipelines})
        if sorted(stage.ranks) != placed:
            raise UsageError(f"--partition {path}: stage {chunk} runs on {_ranks(stage.ranks)}, but {program.name} "
                             f"places chunk {chunk} on {_ranks(placed)}: the partition's ranks and replicas must be "
                             "the program's placement (change one of them)")
    return dataclasses.replace(spec, build_chunk=LayeredChunks(spec.layers, partition.cut, f"--partition {path}"))


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


def partition_cut(spec) -> Cut | None:
    """The cut a partition file gave ``spec``'s chunks (``cut_by_partition``), or None (even, or the spec's own)."""
    return spec.build_chunk.cut if spec.derives_chunks else None


__all__ = ["Cut", "LayerStack", "LayeredChunks", "LayeredModel", "build_layers", "cut_by_partition", "even_cut",
           "partition_cut"]
