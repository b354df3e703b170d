"""A shrink cut by its time bound reports the smallest failure so far, not the one first seen.

The bound is raised from inside a scenario (``ShrinkTimeUp``); when that lands on a prefix
Hypothesis has replayed before, Hypothesis reports "inconsistent data generation"
(``FlakyStrategyDefinition``) instead. Both arrivals mean the same cut. A failure that stops
reproducing while being shrunk, with time left, is still reported as found and marked flaky.
"""
from __future__ import annotations

import time

import pytest
from hypothesis.errors import FlakyStrategyDefinition

from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.fuzz import fuzz
from mla_fuzz.harness.machine import FuzzFailure
from mla_fuzz.harness.mutants import HostSplitDecision
from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.mla_ref import ModelSpec

CFG = ScenarioConfig(spec=ModelSpec.tiny(num_heads=4).to_dict(), page_size=16, next_n=1, capture_sizes=[2],
                     max_pages_per_seq=16, seed=3)
CAPTURE = {"op": "capture", "size": 2, "batch": {"seed": 1, "seq_lens": [1, 1], "q_lens": [1, 1], "max_decode_len": 1},
           "warmups": 0, "share": False}
REPLAY = {"op": "replay", "size": 2, "batch": {"seed": 2, "seq_lens": [200, 9], "q_lens": [1, 1], "max_decode_len": 1},
          "poison": False}
EAGER = {"op": "eager", "batch": {"seed": 4, "seq_lens": [7], "q_lens": [1], "max_decode_len": 1}, "pad_to": None,
         "poison": False}


def _failure(steps):
    f = run_steps(HostSplitDecision, CFG, steps, "emulated")
    assert f is not None and f.step == len(steps) - 1, f  # a real failure of the mutant, at its last step
    return FuzzFailure(f, CFG, list(steps))


@pytest.mark.parametrize("time_spent", [True, False])
def test_a_cut_shrink_reports_the_smallest_failure_so_far(monkeypatch, time_spent):
    first = _failure([CAPTURE, EAGER, REPLAY])  # as first seen
    smaller = _failure([CAPTURE, REPLAY])  # what shrinking had reached

    def search(camp, **kw):
        camp.shrink_seconds = kw["shrink_seconds"]
        camp.first_failure, camp.latest_failure = first, smaller
        seen = time.monotonic() - (10.0 if time_spent else 0.0)
        camp.stats["first_failure"] = {"examples": 1, "time": seen, "key": "replay-eager"}
        raise FlakyStrategyDefinition("Inconsistent data generation! Data generation behaved differently")

    monkeypatch.setattr("mla_fuzz.harness.fuzz.search", search)
    report = fuzz("mutant:host-split-decision", graph_mode="emulated", examples=1, seed=0, shrink_seconds=5)
    steps = report.repro["steps"]
    if time_spent:
        assert len(steps) == 2 and "flaky" not in report.repro["search"], report.repro["search"]
    else:
        assert len(steps) == 3 and report.repro["search"]["flaky"].startswith("FlakyStrategyDefinition")
    assert report.repro["diagnosis"]["cls"] == "laziness"
