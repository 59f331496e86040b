"""Tests that check a benchmark's figures load its script (``benchmarks/`` is not a package) through here."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_benchmark(name: str):
    """``benchmarks/NAME.py`` as a module, registered under NAME first (dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
