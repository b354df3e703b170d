"""pytest plugin (entry point ``pytest11``): run the property suite on any backend.

    pytest --pyargs mla_fuzz.harness.suite --mla-backend=mypkg.backend:MyBackend --mla-graph=emulated

Options: ``--mla-backend`` (default ``triton``), ``--mla-graph`` (default ``auto``),
``--mla-examples`` (fuzz examples per test, default 40), ``--mla-spec`` (``tiny``),
``--mla-corpus`` (where failing scenarios' repro files go), ``--mla-max-seq-len`` (longest
sequence the search draws). The suite honours the
backend's ``capabilities``: a fixed scenario outside them is skipped with the reason. As
``mla-fuzz run`` does, kernels on CPU tensors run under Triton's interpreter, chosen here
before anything imports them. A bad option is a pytest usage error (one line).
"""
from __future__ import annotations

import os
import tempfile

import pytest

_DEFAULT_CORPUS = os.path.join(tempfile.gettempdir(), "mla-fuzz-suite")


def pytest_addoption(parser):
    group = parser.getgroup("mla-fuzz", "MLA decode property suite")
    group.addoption("--mla-backend", default="triton",
                    help="backend under test: 'triton', 'mutant:NAME' or 'package.module:Class'")
    group.addoption("--mla-graph", default="auto", choices=("auto", "cuda", "emulated", "eager"),
                    help="graph mode for the property suite")
    group.addoption("--mla-examples", type=int, default=40, help="fuzz examples per property test")
    group.addoption("--mla-spec", default="tiny", choices=("tiny", "deepseek-v3"), help="model dimensions")
    group.addoption("--mla-max-seq-len", type=int, default=None, metavar="N",
                    help="longest sequence the fuzz search draws (default per spec and device, as mla-fuzz run)")
    group.addoption("--mla-corpus", default=None, metavar="DIR",
                    help=f"where repro files of failures go (default $MLA_FUZZ_CORPUS or {_DEFAULT_CORPUS})")


def _targets_suite(config) -> bool:
    args = [str(a) for a in config.invocation_params.args]
    return any("mla_fuzz.harness.suite" in a or "harness/suite" in a or a.startswith("--mla-") for a in args)


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_configure(config):
    """Set up like ``mla-fuzz run`` when this session runs the suite: the interpreter on CPU,
    and every option checked now, as a usage error."""
    if not _targets_suite(config):
        return
    graph = config.getoption("--mla-graph")
    if graph == "cuda" and not _cuda():
        raise pytest.UsageError("--mla-graph cuda: no CUDA device is available; use --mla-graph emulated or auto")
    cpu = graph == "emulated" or not _cuda()
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from mla_fuzz.harness.loading import effective_capabilities, load_backend
    ref = config.getoption("--mla-backend")
    try:
        effective_capabilities(load_backend(ref), None, cpu=cpu)
    except ValueError as exc:
        raise pytest.UsageError(f"--mla-backend {ref}: {exc}") from None
    msl = config.getoption("--mla-max-seq-len")
    if msl is not None and msl < 1:
        raise pytest.UsageError(f"--mla-max-seq-len: expected a positive integer, got {msl}")
    corpus = config.getoption("--mla-corpus")
    if corpus is not None:
        try:
            os.makedirs(corpus, exist_ok=True)
        except OSError as exc:
            raise pytest.UsageError(f"--mla-corpus {corpus}: cannot create it ({exc.strerror})") from None
        if not os.access(corpus, os.W_OK):
            raise pytest.UsageError(f"--mla-corpus {corpus}: not writable")


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


@pytest.fixture(scope="session")
def mla_max_seq_len(request):
    """``--mla-max-seq-len`` (None: per spec and device)."""
    return request.config.getoption("--mla-max-seq-len")


@pytest.fixture(scope="session")
def mla_corpus(request) -> str:
    """Where the suite writes repro files: ``--mla-corpus``, ``$MLA_FUZZ_CORPUS`` or a temp folder."""
    return request.config.getoption("--mla-corpus") or os.environ.get("MLA_FUZZ_CORPUS", _DEFAULT_CORPUS)


@pytest.fixture(scope="session")
def mla_capabilities(request, mla_backend_ref, mla_graph_mode):
    """What the backend declares, as the fuzzer draws it here (``effective_capabilities``)."""
    from mla_fuzz.harness.fuzz import resolve_mode
    from mla_fuzz.harness.graphs import default_device
    from mla_fuzz.harness.loading import effective_capabilities, load_backend

    cpu = default_device(resolve_mode(mla_graph_mode)) == "cpu"
    try:
        return effective_capabilities(load_backend(mla_backend_ref), None, cpu=cpu)[0]
    except ValueError as exc:
        raise pytest.UsageError(f"--mla-backend {mla_backend_ref}: {exc}") from None
