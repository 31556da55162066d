"""The compiled operator library, loaded once: its operators (``torch.ops.relpos``) and, when it
was built with Python's headers, the Python module it also is (``STEPS``, registered as
``relpos._relpos_ops``: a StepPlan's steps called directly, ``step_decode(plan, ...)`` and
``step_transform(plan, ...)``, the arguments of the plan's ``decode`` and ``transform`` methods;
None otherwise, and the package calls those methods instead)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pathlib
import sys

import torch

# RELPOS_OPS_LIBRARY: another build of the operator library (a source checkout run in place; built
# as a Python module, it loads only into the Python version it was built for)
LIB = pathlib.Path(os.environ.get("RELPOS_OPS_LIBRARY")
                   or pathlib.Path(__file__).with_name("_relpos_ops.so"))
if not LIB.exists():  # pragma: no cover - a broken install
    raise ImportError(f"relpos: the operator library {LIB} is missing; reinstall the package")
torch.ops.load_library(str(LIB))

_NAME = "relpos._relpos_ops"


def _python_module():
    """The loaded library as the module relpos._relpos_ops (the same file, so the same loaded
    object: its operators are not registered twice), or None when it has no module init or its
    functions cannot take a plan (a pybind11 of another ABI than LibTorch's: one probe call)."""
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(LIB))  # (any file name)
    spec = importlib.util.spec_from_file_location(_NAME, LIB, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        x = torch.zeros(1, 1, 1, 2)  # (a plan without parameters: returns at once, stale)
        module.step_transform(torch.classes.relpos.StepPlan("rope", 2, 1), x, x,
                              torch.zeros(1, dtype=torch.float64), [], 0, False, 0)
    except (ImportError, TypeError):
        return None
    # registered, so that importing it by name finds this one (another file of the library
    # loaded as well would register its operators twice, which aborts the process)
    return sys.modules.setdefault(_NAME, module)


STEPS = _python_module()
