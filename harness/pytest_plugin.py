"""pytest plugin (entry point ``pytest11``): run the property suite on any backend.

    pytest --pyargs mla_fuzz.harness.suite --mla-backend=mypkg.backend:MyBackend --mla-graph=emulated

Options: ``--mla-backend`` (default ``triton``), ``--mla-graph`` (default ``auto``),
``--mla-examples`` (fuzz examples per test, default 40), ``--mla-spec`` (``tiny``).
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("mla-fuzz", "MLA decode property suite")
    group.addoption("--mla-backend", default="triton",
                    help="backend under test: 'triton', 'mutant:NAME' or 'package.module:Class'")
    group.addoption("--mla-graph", default="auto", choices=("auto", "cuda", "emulated", "eager"),
                    help="graph mode for the property suite")
    group.addoption("--mla-examples", type=int, default=40, help="fuzz examples per property test")
    group.addoption("--mla-spec", default="tiny", choices=("tiny", "deepseek-v3"), help="model dimensions")


@pytest.fixture(scope="session")
def mla_backend_ref(request) -> str:
    """The backend reference given by ``--mla-backend``, checked to load."""
    from mla_fuzz.harness.loading import load_backend

    ref = request.config.getoption("--mla-backend")
    try:
        load_backend(ref)
    except ValueError as exc:
        raise pytest.UsageError(f"--mla-backend: {exc}") from None
    return ref


@pytest.fixture(scope="session")
def mla_graph_mode(request) -> str:
    return request.config.getoption("--mla-graph")


@pytest.fixture(scope="session")
def mla_examples(request) -> int:
    return request.config.getoption("--mla-examples")


@pytest.fixture(scope="session")
def mla_spec(request) -> str:
    return request.config.getoption("--mla-spec")
