"""pytest plugin that puts cula's FLA drop-ins in place of FLA's functions before FLA's test modules
import them (load with ``-p swap`` and this folder on PYTHONPATH; ``tools/fla_suite/run.py`` does).

Every public function of cula's drop-in modules replaces the function of the same name in FLA's
package of the same name (``cula.kda.chunk_kda`` -> ``fla.ops.kda.chunk_kda``) and in that package's
submodules that define it (``fla.ops.kda.chunk``, ``fla.ops.kda.fused_recurrent``, ...). Each test's
outcome, the first line of its error and the cula functions it called are written as JSON lines to
the file named by CULA_FLA_SUITE_LOG, so the runner can tell tests of cula's functions from tests
that exercise only FLA's own kernels."""

from __future__ import annotations

import functools
import importlib
import json
import os
import pkgutil

FAMILIES = ("kda", "gated_delta_rule", "delta_rule", "gla", "simple_gla", "lightning_attn", "retention")
NOT_FLA = {"lightning_decay"}  # cula helpers with no FLA counterpart

_called: set[str] = set()
_swapped: dict[str, list[str]] = {}


def _counted(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _called.add(name)
        return fn(*args, **kwargs)

    return wrapper


def swap_all() -> dict[str, list[str]]:
    """Replaces FLA's functions by cula's; returns {cula function: [FLA modules it replaced it in]}."""
    for family in FAMILIES:
        mine = importlib.import_module(f"cula.{family}")
        package = importlib.import_module(f"fla.ops.{family}")
        modules = [package]
        for sub in pkgutil.iter_modules(package.__path__):
            try:
                modules.append(importlib.import_module(f"{package.__name__}.{sub.name}"))
            except ImportError:  # an optional backend of FLA's (TileLang, ...) not installed here
                pass
        for name in mine.__all__:
            if name in NOT_FLA:
                continue
            fn = _counted(f"{family}.{name}", getattr(mine, name))
            for module in modules:
                if hasattr(module, name):
                    setattr(module, name, fn)
                    _swapped.setdefault(f"{family}.{name}", []).append(module.__name__)
    return _swapped


def host_only() -> None:
    """On a machine without a GPU, FLA's tests run on host tensors: FLA's `device` says 'cpu' (its
    Triton probe can say 'cuda' where the CUDA libraries exist without a driver), and FLA's conftest
    synchronising torch.cuda after every test has nothing to wait for."""
    import torch

    if torch.cuda.is_available():
        return
    import fla.utils
    import fla.utils.hardware

    for module in (fla.utils, fla.utils.hardware):
        module.device = module.device_name = "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None


# at import (``-p swap`` imports this before FLA's conftest and test modules import from fla)
host_only()
swap_all()


def _short_id(nodeid: str) -> str:
    """test_kda.py::test_gate[...]: the test's id without the folders (they differ between machines)."""
    return nodeid.rsplit("/", 1)[-1]


def pytest_collection_modifyitems(config, items):
    """Deselects the tests named (short ids, one per line) in the file CULA_FLA_SUITE_SKIP: those an
    earlier run found to call none of cula's functions, whose FLA kernels would only cost time."""
    path = os.environ.get("CULA_FLA_SUITE_SKIP")
    if not path:
        return
    skip = set(open(path).read().split("\n"))
    dropped = [item for item in items if _short_id(item.nodeid) in skip]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if _short_id(item.nodeid) not in skip]


def pytest_runtest_logstart(nodeid, location):
    _called.clear()  # before setup, where skip marks and fixtures run


def _log(record):
    path = os.environ.get("CULA_FLA_SUITE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report):
    # one record per test: its call phase, or the phase that failed or skipped before it
    if report.when == "call" or report.outcome != "passed":
        error = None
        if report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            error = (crash.message if crash is not None else str(report.longrepr)).strip().splitlines()[0][:300]
        elif report.outcome == "skipped":
            longrepr = report.longrepr
            error = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[:300]
        _log(dict(test=report.nodeid, when=report.when, outcome=report.outcome, error=error,
                  xfail=hasattr(report, "wasxfail"), cula=sorted(_called)))


def pytest_sessionstart(session):
    _log(dict(swapped=_swapped))
