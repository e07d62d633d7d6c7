"""Load a script of ``benchmarks/`` as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, module_name: str) -> ModuleType:
    """``benchmarks/<script>`` imported as ``module_name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
