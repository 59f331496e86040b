"""Compile schedule text in tests, and read the errors it raises: the helpers the language tests share."""
from __future__ import annotations

import textwrap

import pytest

from pipec.compiler.driver import task_kinds
from pipec.dsl import parse, resolve
from pipec.errors import SourceErrors


def spec_of(text: str, name: str | None = None, **params):
    """The evaluated schedule ``name`` (the only one when None) of ``text``, as file ``t.pipe``."""
    source = textwrap.dedent(text)
    module = parse(source, "t.pipe")
    return resolve(module.schedule(name), "t.pipe", source, task_kinds()).evaluate(params)


def error_of(exc_type, text: str, **params):
    """The ``exc_type`` that compiling ``text`` with ``params`` raises."""
    with pytest.raises(exc_type) as info:
        spec_of(text, **params)
    return info.value


def located(error, line: int, col: int) -> str:
    """The error's message, after checking its place and that its rendering shows it."""
    assert (error.span.file, error.span.line, error.span.col) == ("t.pipe", line, col), error.render()
    assert error.render().startswith(f"t.pipe:{line}:{col}: {error.message}")
    return error.message


def messages(error) -> list[tuple[int, int, str]]:
    """(line, col, message) of every error raised at once, in the order found."""
    errors = error.errors if isinstance(error, SourceErrors) else [error]
    return [(e.span.line, e.span.col, e.message) for e in errors]
