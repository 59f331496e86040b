"""pipec's Python API: compile a schedule, or load a compiled program, into a ``Program`` that checks,
simulates, draws and exports itself (docs/api.md).

The command line is built on it (``pipec check``, ``simulate``, ``compile``): a program compiled here
is the one ``pipec compile`` writes, a simulation the one ``pipec simulate`` prints. Every error is a
``PipecError`` (``pipec.errors``), as on the command line. Nothing here imports torch; only
``Program.to_torch_csv(comms=True)`` looks at the installed one, as ``pipec compile --format
torch-csv-comms`` does.
"""
from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any, Mapping, Union

from pipec.errors import CostFileError, UsageError

if TYPE_CHECKING:  # the compiler's modules are imported where they are used: `pipec check` pays for what it uses
    from pipec.compiler.costs import CostModel
    from pipec.compiler.ir import Program as IRProgram
    from pipec.compiler.memory_counts import Number
    from pipec.simulation import Simulation

# A parameter's value as a schedule takes it: an integer, a bool, or either written as text ("4", "true").
ParamValue = Union[int, bool, str]
# A cost model: a cost file's path, its parsed JSON (docs/costs.md), or a model already built.
Costs = Union[str, "os.PathLike[str]", Mapping[str, Any], "CostModel", None]


def compile(target: str | os.PathLike[str], params: Mapping[str, ParamValue] | None = None, *, costs: Costs = None,
            memory_budget: int | None = None, byte_budget: Mapping[str, Number] | None = None) -> Program:
    """Compile a schedule and prove the result safe, as ``pipec check TARGET -D ...`` does.

    Args:
        target: a ``.pipe`` file, or a shipped schedule's name (``pipec list``); ``FILE:NAME`` picks one
            schedule of a file that has several.
        params: schedule parameters, ``{"P": 4, "N": 8}`` (what ``-D P=4 -D N=8`` sets).
        costs: the cost model that orders greedy schedules, prices ``simulate`` and sizes ``byte_budget``
            (default: unit costs F=1 B=2 I=W=1).
        memory_budget: the most chunk activations a rank may hold (``--budget``).
        byte_budget: size class -> the most bytes of its values a rank may hold (``--budget-bytes``);
            every class needs a size in the cost model's ``sizes``.
    Returns:
        the checked program.
    Raises:
        PipecError: the schedule's ``SourceError`` (``file:line:col:``), a ``ProgramError`` of the checks
            (``rank R, step S:``), a ``CostFileError``, or a ``UsageError`` for a bad argument.
    """
    from pipec.compiler.driver import compile_target

    model = cost_model(costs)
    budget = _byte_budget(byte_budget, model)
    compiled = compile_target(_path(target, "target"), _params(params), costs=model,
                              memory_budget=_count(memory_budget, "memory_budget"), byte_budget=budget)
    return Program(compiled.program, model)


def load(source: str | os.PathLike[str], *, costs: Costs = None, check: bool = True) -> Program:
    """A compiled program (``pipec compile --format json``, or ``Program.to_json()``) from its text or a file.

    Args:
        source: the JSON text (a string whose first non-blank character is ``{``), or a path to it
            (any other string, or an ``os.PathLike``; ``load_file`` takes a path whatever its name).
        costs: the cost model for ``simulate`` and the byte sizes (default: unit costs).
        check: prove it safe before returning it, with ``pipec check``'s checks (an edited file may not be).
    Raises:
        UsageError: not a regular file, too large, not JSON, or not a pipec program.
        ProgramError: the content is invalid, or (``check``) a check fails.
    """
    if not isinstance(source, str) or source.lstrip(" \t\r\n\ufeff")[:1] != "{":
        return load_file(source, costs=costs, check=check)
    program = Program(_program_from_text(source), cost_model(costs))
    if check:
        program.check()
    return program


def load_file(path: str | os.PathLike[str], *, costs: Costs = None, check: bool = True) -> Program:
    """``load`` for a file, read through pipec's guarded reader (a regular file, at most 256 MiB)."""
    from pipec.compiler.guarded_read import read_program

    program = Program(read_program(_path(path, "load")), cost_model(costs))
    if check:
        program.check()
    return program


def cost_model(costs: Costs) -> CostModel | None:
    """``costs`` as a ``CostModel`` (None stays None: unit costs).

    Raises:
        CostFileError: a file or a parsed cost file that is not a valid one (docs/costs.md).
    """
    from pipec.compiler.costs import CostModel, costs_from_json, load_costs

    if costs is None or isinstance(costs, CostModel):
        return costs
    if isinstance(costs, Mapping):
        return costs_from_json(_as_read(costs), _GIVEN_COSTS)
    if isinstance(costs, (str, os.PathLike)):
        return load_costs(os.fspath(costs))
    raise CostFileError(f"costs: expected a cost file's path, its parsed JSON or a CostModel, got {type(costs).__name__}")


# How messages name a cost model given as a dict.
_GIVEN_COSTS = "<costs given to pipec>"


def _as_read(costs: Mapping[str, Any]) -> Any:
    """A cost file given as a dict, as pipec's guarded reader would have read it from a file: JSON's types
    only (text keys, finite numbers in range), at most the cost file's size limit.

    Raises:
        CostFileError: what is not JSON (a NaN, a set, a key that is not text), or what the reader refuses.
    """
    import json

    from pipec.compiler.guarded_read import COSTS, parse_json_text

    try:
        if any(not isinstance(key, str) for key in _keys(costs)):
            raise TypeError("a key that is not text")
        text = json.dumps(costs, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise CostFileError(f"{_GIVEN_COSTS}: not what a JSON cost file can hold ({error})") from None
    if len(text) > COSTS.limit:
        raise CostFileError(f"{_GIVEN_COSTS}: over {COSTS.limit_text} as JSON, the limit for {COSTS.noun}")
    return parse_json_text(text, _GIVEN_COSTS, CostFileError, "cost file")


def _keys(value: Any):
    """Every key of every mapping in ``value``, nested in mappings and lists."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield key
            yield from _keys(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _keys(item)


class Program:
    """A compiled program: one instruction list per rank (docs/api.md).

    Attributes:
        ir: the compiler's program (``pipec.compiler.ir.Program``): every instruction, stage and
            communicator. Its shape may change between versions; the methods here do not.
        costs: the cost model it was compiled with (None: unit costs).
    """

    def __init__(self, ir: IRProgram, costs: CostModel | None = None):
        self.ir = ir
        self.costs = costs

    def __repr__(self) -> str:
        return f"<pipec.Program {self.name} ({self.params_text}): {self.num_ranks} ranks>"

    @property
    def name(self) -> str:
        """The schedule's name (``one_f_one_b``; a shipped one's file name as it was given, ``1f1b``)."""
        return self.ir.name

    @property
    def params(self) -> dict[str, int | bool]:
        """Every parameter's value, defaults included."""
        return dict(self.ir.params)

    @property
    def params_text(self) -> str:
        """The parameters as pipec prints them: ``P=4, N=8, remat=false``."""
        from pipec.compiler.defines import params_text

        return params_text(self.ir.params)

    @property
    def num_ranks(self) -> int:
        return self.ir.num_ranks

    @property
    def num_microbatches(self) -> int:
        return self.ir.num_microbatches

    @property
    def num_stages(self) -> int:
        return len(self.ir.stages)

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` computes, ascending (a stage placed on a group of ranks is on each member).

        For a program of one pipeline, stage ``s`` is the ``s``-th along it: torch's ``stage_index``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int):  # a rank given as text is no rank out of range
            raise UsageError(f"rank: expected an int, got {type(rank).__name__} {rank!r}")
        if not 0 <= rank < self.num_ranks:
            raise UsageError(f"rank {rank} is out of range: {self.name} has {self.num_ranks} ranks")
        return tuple(sorted(info.id for info in self.ir.stages if rank in info.ranks))

    def instruction_count(self) -> int:
        """Instructions over all ranks."""
        return self.ir.instruction_count()

    def check(self, *, memory_budget: int | None = None, byte_budget: Mapping[str, Number] | None = None) -> None:
        """Prove the program safe with ``pipec check``'s checks: every message matched in order, no deadlock,
        no conflict, memory within the budgets (sized by ``self.costs``).

        Raises:
            ProgramError: the first check that fails (``rank R, step S:`` and the grid around it).
            UsageError: a bad budget.
        """
        from pipec.compiler.checks import check_all

        from pipec.compiler.placed_memory import unpriced

        budget = _byte_budget(byte_budget, self.costs)
        missing = unpriced(self.ir, budget or {}, self._sizes())
        if missing:  # a shard budget priced by the weight bytes, on a program without a sharded stage
            raise UsageError(f"byte_budget {missing[0]}: needs its size; this program shards no stage's weights, "
                             f'so the weight size gives none: give costs with "sizes": {{"{missing[0]}": BYTES}}')
        check_all(self.ir, semantics="rendezvous", memory_budget=_count(memory_budget, "memory_budget"),
                  byte_budget=budget, sizes=self._sizes())

    def simulate(self) -> Simulation:
        """Predict one training step under ``self.costs``: makespan, bubble, memory per rank.

        Raises:
            NumberLimitError: a total past pipec's range, naming the cost file.
        """
        from pipec.compiler.guarded_read import checked_total
        from pipec.compiler.simulate import simulate
        from pipec.compiler.versions import flushed_makespan, version_plan, version_summary
        from pipec.simulation import Simulation

        result = simulate(self.ir, self.costs, sizes=self._sizes() or None)
        plan = version_plan(self.ir)
        if plan is None:
            return Simulation(result)
        # asynchronous training: the same updates with a flush after each, for the throughput it gains
        flushed = flushed_makespan(self.ir, plan, self.costs)
        checked_total(flushed, "the makespan with a flush after every update", self.costs.source if self.costs else "")
        return Simulation(result, version_summary(self.ir, plan), flushed)

    def render(self, path: str | os.PathLike[str]) -> None:
        """Draw the program into ``path``; its suffix picks the drawing, as for ``pipec render``: the simulated
        timeline (``.svg``, ``.html``, ``.json`` for Perfetto) or the task graph (``.dot``, ``.png``).

        Raises:
            UsageError: another suffix, a PNG without Graphviz's ``dot``, or a file that cannot be written
                (the old one is left as it was).
        """
        from pipec.compiler.render import GRAPH_FORMS, form_of, write_graph, write_timeline
        from pipec.compiler.simulate import simulate

        path = os.fspath(path)
        if form_of(path) in GRAPH_FORMS:
            write_graph(self.ir, path)
        else:
            write_timeline(simulate(self.ir, self.costs), self.ir, path)

    def to_text(self) -> str:
        """The per-rank grid, as ``pipec compile --format text`` prints it."""
        from pipec.compiler.emit import format_text_grid

        return format_text_grid(self.ir)

    def to_json(self) -> str:
        """The program as ``pipec compile --format json`` writes it; ``pipec.load`` reads it back."""
        out = io.StringIO()
        self.write_json(out)
        return out.getvalue()

    def write_json(self, out: io.TextIOBase) -> None:
        """Stream ``to_json()``'s text into ``out`` (a large program's JSON is never held whole)."""
        from pipec.compiler.emit.json_program import write_program_json

        write_program_json(self.ir, out)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``to_json()``'s text to ``path``, atomically: the old file stays whole until the new one is."""
        from pipec.compiler.atomic_write import atomic_writer

        with atomic_writer(os.fspath(path)) as out:
            self.write_json(out)

    def to_torch_csv(self, comms: bool = False) -> str:
        """torch.distributed.pipelining's schedule CSV (docs/formats.md, docs/torch.md).

        Args:
            comms: False: compute actions only (torch's ``format="compute_only"``: torch adds the messages).
                True: with pipec's own sends and receives (``format="compute_comms"``), written for the installed
                torch's ``_PipelineScheduleRuntime`` (``REDUCE_GRAD``, ``UNSHARD``/``RESHARD`` where it needs
                them), or for the newest torch pipec accepts when none is installed; this imports torch.
        Raises:
            UsageError: a program torch's single chain of stages cannot express (replicated stages, weight
                passing, sequence rings).
        """
        from pipec.compiler.emit.torch_csv import NEWEST_TORCH, installed_torch_runtime, write_torch_csv

        if not comms:
            return write_torch_csv(self.ir, with_comms=False)
        runtime = installed_torch_runtime()
        # without a torch here that could load it, the form the newest accepted torch runs exactly
        target = runtime if runtime is not None and runtime.loads_comms else NEWEST_TORCH
        return write_torch_csv(self.ir, with_comms=True, for_torch=target)

    def torch_caveats(self) -> list[str]:
        """What the installed torch's runtime would not run exactly in ``to_torch_csv(comms=True)`` (empty on
        torch 2.10 to 2.13); this imports torch."""
        from pipec.compiler.emit.torch_csv import installed_torch_runtime, runtime_caveats

        return list(runtime_caveats(self.ir, installed_torch_runtime()))

    def _sizes(self) -> dict[str, Number]:
        return self.costs.sizes if self.costs is not None else {}


def _path(path: str | os.PathLike[str], what: str) -> str:
    """``path`` as text (a file's path, or a shipped schedule's name)."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"{what}: expected a path or a name, got {type(path).__name__}")
    return os.fspath(path)


def _params(params: Mapping[str, ParamValue] | None) -> dict[str, ParamValue]:
    """``params`` checked for shape (the schedule checks names, types and ranges)."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise UsageError(f"params: expected a mapping of parameter names to values, got {type(params).__name__}")
    for name, value in params.items():
        if not isinstance(name, str) or not isinstance(value, (int, str)):
            raise UsageError(f"params: {name!r}: expected a name and an integer, a bool or text, "
                             f"got {type(value).__name__}")
    return dict(params)


def _count(value: int | None, what: str) -> int | None:
    """A budget in activations: None, or an int from 0 up (a bool is not one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{what}: expected a count from 0 up, got {value!r}")
    return value


def _byte_budget(budget: Mapping[str, Number] | None, costs: CostModel | None) -> dict[str, Number] | None:
    """``budget`` checked: known size classes, each sized by ``costs``, numbers from 0 within pipec's range.

    Raises:
        UsageError: naming the class and what is wrong.
    """
    from pipec.compiler.guarded_read import INT_LIMIT
    from pipec.compiler.ops import SIZE_CLASSES
    from pipec.compiler.placed_memory import may_size

    if budget is None:
        return None
    if not isinstance(budget, Mapping):
        raise UsageError(f"byte_budget: expected a mapping of size classes to bytes, got {type(budget).__name__}")
    sizes = costs.sizes if costs is not None else {}
    for size_class, nbytes in budget.items():
        if size_class not in SIZE_CLASSES:
            raise UsageError(f"byte_budget: unknown size class {size_class!r} (expected one of {', '.join(SIZE_CLASSES)})")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 <= nbytes < INT_LIMIT:
            raise UsageError(f"byte_budget {size_class}: expected a number of bytes from 0 up, below 2^63, got {nbytes!r}")
        if not may_size(size_class, sizes):
            raise UsageError(f"byte_budget {size_class}: needs its size; give costs with \"sizes\": "
                             f'{{"{size_class}": BYTES}}')
    return dict(budget)


def _program_from_text(text: str) -> IRProgram:
    """A compiled program from its JSON text, read as ``read_program`` reads a file (size limit included)."""
    from pipec.compiler.emit.json_program import FORMAT, program_from_json
    from pipec.compiler.guarded_read import PROGRAM, parse_json_text, quote

    if len(text) > PROGRAM.limit:  # characters: at least as many bytes
        raise UsageError(f"<program text>: over {PROGRAM.limit_text}, the limit for {PROGRAM.noun}")
    data = parse_json_text(text, "<program text>", UsageError, "program")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = quote(data.get("format")) if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise UsageError(f"<program text>: not a pipec program (a JSON object with \"format\": \"{FORMAT}\"; found {found})")
    return program_from_json(data)
