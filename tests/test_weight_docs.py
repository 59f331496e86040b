"""The weight-passing examples of docs/language.md (section 11) compile, pass every check and simulate."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate

_PAGE = Path(__file__).parent.parent / "docs" / "language.md"


def _examples() -> list[str]:
    text = _PAGE.read_text()
    section = text[text.index("## 11. Weight passing"):]
    return [block for block in re.findall(r"```\n(.*?)```", section, re.S) if block.startswith("schedule ")]


def test_the_page_has_the_three_examples():
    names = [re.match(r"schedule (\w+)", block).group(1) for block in _examples()]
    assert names == ["weipipe", "tawpipe", "fsdp"]


@pytest.mark.parametrize("index", range(3))
def test_each_example_compiles_checks_and_simulates(tmp_path, index):
    path = tmp_path / "example.pipe"
    path.write_text(_examples()[index])
    compiled = compile_target(str(path))
    assert compiled.program.weights is not None
    assert 0 <= simulate(compiled.program).bubble_ratio < 1
