"""Suite-wide setup: interpreter on CPU, `gpu` marker, Hypothesis profiles."""
import importlib.util
import os
import sys

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # torch missing: let the import errors in tests speak
    _HAS_CUDA = False

# Kernels run through Triton's interpreter on CPU; it must be chosen before triton
# compiles anything, hence here rather than in the tests.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest-xdist runs one worker per core; intra-op threads on top only oversubscribe
    # the CPU (measured: ~1.7x more CPU time at -n 2 with torch's default threads).
    torch.set_num_threads(1)

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # the interpreter's speed-ups (same results), installed explicitly: nothing in kernels does it
    from mla_fuzz.kernels import interpreter_patches  # noqa: E402

    interpreter_patches.install()

# A developer's `mla-fuzz server` must not run the suite's commands: the server tests turn it
# on for themselves, with servers of their own (tests/cli/test_server.py).
os.environ["MLA_FUZZ_SERVER"] = "0"

from hypothesis import HealthCheck, settings  # noqa: E402

# `ci` is loaded by Hypothesis itself when CI is set (derandomized, no database).
settings.register_profile(
    "dev", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "gpu", deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
if not os.environ.get("CI"):
    settings.load_profile(os.environ.get("MLA_FUZZ_HYPOTHESIS_PROFILE", "dev"))


def pytest_configure(config):
    """Stop at once when the installed mla-fuzz is another checkout's: the tests' subprocesses
    (``python -m mla_fuzz...`` from a temporary folder) would run its code while pytest runs
    this one's, and fail far from the cause."""
    import subprocess
    here = os.path.realpath(os.path.join(TESTS_DIR, "..", "harness", "__init__.py"))
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            "print(u.find_spec('mla_fuzz.harness').origin)"],
                           cwd="/", capture_output=True, text=True)
    installed = os.path.realpath(probe.stdout.strip()) if probe.returncode == 0 else None
    if installed != here:
        where = os.path.dirname(os.path.dirname(installed)) if installed else "nowhere (not installed)"
        pytest.exit(f"mla-fuzz is installed from {where}, not from this checkout "
                    f"{os.path.dirname(TESTS_DIR)}: run `bash ci/setup.sh` here first", returncode=2)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_device():
    """The CUDA device for `gpu` tests."""
    return torch.device("cuda")


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def fakes(monkeypatch):
    """Worker processes (and this one) can import ``cli_fakes``: the tests' directory goes
    first on ``PYTHONPATH`` and ``sys.path``."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS_DIR] + parts))
    monkeypatch.syspath_prepend(TESTS_DIR)


@pytest.fixture
def load_benchmark(monkeypatch):
    """``load_benchmark(name)``: ``benchmarks/<name>.py`` imported as a module (benchmarks/ is
    not a package); ``sys.path``, which the scripts extend, is restored afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def load(name):
        path = os.path.join(TESTS_DIR, "..", "benchmarks", f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
