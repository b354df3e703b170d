"""Same seed, same cases, whatever ran before in the process.

Hypothesis mixes into its draws constants it collects from the source of every *local*
module loaded when a test case starts (not the standard library's, not site-packages', not
test files'); a module imported later (the diagnosis, a mutant, an example backend, by the
search itself or by an earlier search in the same process) changes the pool, so the same
seed would draw other cases in a fresh worker than in one that has run a chunk before.
``settle(backend_cls)`` imports, once per process, every module a search may import (all of
``mla_fuzz``, the backend's own module), so that the pool is the same for every search.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

_DONE: set = set()


def _walk(package: str) -> None:
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
        if info.name in sys.modules:
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - e.g. GPU-only modules on a CPU machine: never loaded there either
            pass


def settle(backend_cls=None) -> None:
    """Import every module a search can load (module doc); idempotent."""
    if "mla_fuzz" not in _DONE:
        for package in ("mla_fuzz.mla_ref", "mla_fuzz.harness", "mla_fuzz.kernels", "mla_fuzz.examples"):
            _walk(package)
        _DONE.add("mla_fuzz")
    module = getattr(backend_cls, "__module__", None)
    if module and module not in _DONE:
        importlib.import_module(module)
        _DONE.add(module)
