"""Proof that the harness works: the fuzzer's own search catches every mutant, with the
right diagnosis and a short shrunk scenario, and never flags the clean backend.

Nothing here names a bug's input: each test only picks a mutant and a seed; the
scenario that exposes it comes from Hypothesis' search. Under CI (CPU, Triton
interpreter, emulated graphs) the clean backend gets a small example count; the
``slow`` test runs the full 300 (`pytest -m slow`), and the GPU numbers come from
`mla-fuzz mutants --graph cuda` (see README).
"""
import os

import pytest

from mla_fuzz.harness.fuzz import fuzz
from mla_fuzz.harness.mutants import ALL, EXPECTED
from mla_fuzz.harness.repro import replay_repro

SEED = 0
MAX_EXAMPLES = 300


@pytest.mark.parametrize("name", sorted(ALL))
def test_mutant_is_caught_by_search(name):
    report = fuzz(name, spec="tiny", graph_mode="emulated", examples=MAX_EXAMPLES, seed=SEED, shrink_seconds=20)
    assert report.failed, f"{name} escaped {report.examples} examples"
    assert report.examples_to_detect is not None and report.examples_to_detect <= MAX_EXAMPLES
    diag = report.repro["diagnosis"]
    assert diag["cls"] in EXPECTED[name], f"{name}: diagnosed {diag['cls']}: {diag['explanation']}"
    assert 1 <= len(report.repro["steps"]) <= 6
    # the repro alone reproduces it, deterministically, with the same class
    again = replay_repro(report.repro)
    assert again.failed and again.diagnosis.cls == diag["cls"]
    # and the clean backend passes that very scenario
    assert not replay_repro(report.repro, backend="triton", diagnose_failure=False).failed


def test_clean_backend_passes_search():
    n = int(os.environ.get("MLA_FUZZ_CLEAN_EXAMPLES", "20"))
    report = fuzz("triton", spec="tiny", graph_mode="emulated", examples=n, seed=SEED + 1, shrink_seconds=20)
    assert not report.failed, report.repro and report.repro["diagnosis"]
    assert report.examples >= n


@pytest.mark.slow
def test_clean_backend_passes_300_examples():
    report = fuzz("triton", spec="tiny", graph_mode="emulated", examples=300, seed=SEED + 2)
    assert not report.failed, report.repro and report.repro["diagnosis"]
    assert report.examples >= 300
