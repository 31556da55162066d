"""The compiled operator library, loaded once: its operators (``torch.ops.relpos``) and, when it
was built with Python's headers, the Python module it also is (``STEPS``: a StepPlan's steps
called directly, ``step_decode(plan, ...)`` and ``step_transform(plan, ...)``, the arguments of
the plan's ``decode`` and ``transform`` methods; None otherwise, and the package calls those
methods instead)."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import torch

# RELPOS_OPS_LIBRARY: another build of the operator library (a source checkout run in place).
LIB = pathlib.Path(os.environ.get("RELPOS_OPS_LIBRARY")
                   or pathlib.Path(__file__).with_name("_relpos_ops.so"))
if not LIB.exists():  # pragma: no cover - a broken install
    raise ImportError(f"relpos: the operator library {LIB} is missing; reinstall the package")
torch.ops.load_library(str(LIB))


def _python_module():
    """The loaded library as the module relpos._relpos_ops (the same file, so the same loaded
    object: its operators are not registered twice), or None when it has no module init."""
    spec = importlib.util.spec_from_file_location("relpos._relpos_ops", LIB)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:  # built without Python's headers (or for another Python)
        return None
    return module


STEPS = _python_module()
