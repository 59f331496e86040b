"""``Program.communicators`` in the JSON program: written, read back exactly, validated, derived when absent."""
from __future__ import annotations

import copy
import json

import pytest

from pipec.compiler.driver import compile_target
from pipec.compiler.emit import program_from_json, program_to_json
from pipec.compiler.ir import REPLICAS_OF_CHUNK, Communicator
from pipec.errors import ImportError_


def _through_text(data: dict) -> dict:
    return json.loads(json.dumps(data))


def _bitpipe():
    return compile_target("bitpipe", {"P": 4, "N": 4}).program


def test_communicators_are_written_in_creation_order():
    program = _bitpipe()
    assert program.communicators  # replicated chunks
    data = program_to_json(program)
    assert data["communicators"] == [
        {"id": c.id, "ranks": list(c.ranks), "purpose": c.purpose, "key": c.key} for c in program.communicators]
    assert [c["id"] for c in data["communicators"]] == list(range(len(program.communicators)))


def test_communicators_round_trip_exactly():
    program = _bitpipe()
    back = program_from_json(_through_text(program_to_json(program)))
    assert back == program
    assert back.communicators == program.communicators
    assert all(type(c) is Communicator and type(c.ranks) is tuple for c in back.communicators)


def test_given_communicators_are_kept_not_derived_again():
    program = _bitpipe()
    # a program whose groups differ from what its pipelines derive: read back as written
    program.communicators = [Communicator(0, (0, 3), REPLICAS_OF_CHUNK, 1), Communicator(1, (1, 2), REPLICAS_OF_CHUNK, 0)]
    back = program_from_json(_through_text(program_to_json(program)))
    assert back.communicators == program.communicators


def test_a_single_pipeline_has_none_and_round_trips():
    program = compile_target("1f1b", {"P": 4, "N": 8}).program
    data = program_to_json(program)
    assert data["communicators"] == []
    assert program_from_json(_through_text(data)) == program


def test_a_file_without_communicators_derives_them():
    program = _bitpipe()
    data = _through_text(program_to_json(program))
    del data["communicators"]  # a file written before the field existed
    back = program_from_json(data)
    assert back.communicators == program.communicators == _bitpipe().communicators
    assert back == program


def _bad():
    def entry(index, **changes):
        return lambda data: data["communicators"][index].update(changes)

    yield "not a list", lambda data: data.__setitem__("communicators", {"0": []})
    yield "not an object", lambda data: data["communicators"].__setitem__(0, [0, 1])
    yield "id not its index", entry(0, id=1)
    yield "id missing", lambda data: data["communicators"][0].pop("id")
    yield "negative key", entry(0, key=-1)
    yield "key a string", entry(0, key="0")
    yield "rank out of range", entry(0, ranks=[0, 4])
    yield "ranks not ascending", entry(0, ranks=[3, 0])
    yield "ranks repeated", entry(0, ranks=[1, 1])
    yield "no ranks", entry(0, ranks=[])
    yield "ranks not a list", entry(0, ranks=3)
    yield "bool rank", entry(0, ranks=[True, 2])
    yield "unknown purpose", entry(0, purpose="pipeline ring")


@pytest.mark.parametrize("what,mutate", list(_bad()), ids=[name for name, _ in _bad()])
def test_bad_communicators_are_rejected_with_a_pipec_error(what, mutate):
    data = copy.deepcopy(_through_text(program_to_json(_bitpipe())))
    mutate(data)
    with pytest.raises(ImportError_) as info:
        program_from_json(data)
    assert "communicators" in str(info.value)
