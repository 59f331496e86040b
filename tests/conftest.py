"""Fixtures shared by the test files."""
from __future__ import annotations

import pytest


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if ``pipec run`` (or the demo, or ``pipec attention``) would start a worker: what the
    test checks must be refused before any launch."""
    from pipec.commands import run as run_command

    def refuse(*args, **kwargs):
        raise AssertionError("a worker was launched")

    monkeypatch.setattr(run_command, "launch", refuse)
