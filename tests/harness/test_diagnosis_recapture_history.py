"""Diagnosis experiment 3 (capture with the replayed batch) is confounded when the replay reads
stale buffer contents: the re-capture also rewrites what the earlier steps left in the
persistent buffers. Then the failing step's eager forward -- no graph involved -- is wrong after
the scenario's history and right on a fresh backend (experiment 1b's test), and that history,
not a value frozen at capture, is the cause: stale-address.

The backend is the example's two-stage split-KV decode with stage 2 merging splits stage 1 left
unwritten (``example-unguarded-stage2``); its split count is a host int frozen at capture, so the
replay and the eager check partition differently and the replay-eager oracle fires first."""
from __future__ import annotations

import copy

from mla_fuzz.examples.triton_decode import TritonDecodeBackend
from mla_fuzz.harness.diagnosis import diagnose
from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.mutants import EXPECTED, ExampleUnguardedStage2, HostSplitDecision
from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.mla_ref import ModelSpec

CFG = ScenarioConfig(spec=ModelSpec.tiny(num_heads=8).to_dict(), kv_dtype="fp16", q_dtype="fp16", page_size=64,
                     next_n=2, capture_sizes=[8], max_pages_per_seq=8, seed=31356, pool_pages=84)


def _batch(seed, seq_lens):
    return {"seed": seed, "seq_lens": seq_lens, "q_lens": [2] * len(seq_lens), "max_decode_len": 2}


# a short capture batch (few splits), then a replay whose longest row asks for more
STEPS = [{"op": "capture", "size": 8, "batch": _batch(410, [2, 63]), "warmups": 3, "share": False},
         {"op": "replay", "size": 8, "batch": _batch(18268, [2, 512]), "poison": False}]
AS_EAGER = {"op": "eager", "batch": STEPS[1]["batch"], "pad_to": 8, "poison": False}


def test_the_parent_passes_the_scenario():
    assert run_steps(TritonDecodeBackend, CFG, STEPS, "emulated") is None


def test_recapture_vanishing_with_a_history_dependent_eager_step_is_stale_contents():
    f = run_steps(ExampleUnguardedStage2, CFG, STEPS, "emulated")
    assert f is not None and f.oracle == "replay-eager" and f.step == 1, f
    # the confound: capturing with the replayed batch makes it vanish (experiment 3 alone says laziness) ...
    recaptured = copy.deepcopy(STEPS)
    recaptured[0]["batch"] = copy.deepcopy(STEPS[1]["batch"])
    assert run_steps(ExampleUnguardedStage2, CFG, recaptured, "emulated") is None
    # ... but the step's eager forward is wrong after the same history and right alone
    assert run_steps(ExampleUnguardedStage2, CFG, STEPS[:1] + [AS_EAGER], "emulated") is not None
    assert run_steps(ExampleUnguardedStage2, CFG, [AS_EAGER], "emulated") is None
    d = diagnose(ExampleUnguardedStage2, CFG, STEPS, f, "emulated")
    assert d.cls in EXPECTED["example-unguarded-stage2"], d.explanation
    assert "wrong after the earlier steps" in d.explanation and "rewrites that history" in d.explanation, d.explanation
    assert "(the forward: harness/mutants/examples.py:" in d.explanation, d.explanation  # the author's line


# The replay-only shape (found on the GPU): a graph captured for a long row (many splits, frozen)
# replays a short one, whose empty splits hold what an earlier replay wrote there. The eager
# check partitions the short row by its own, smaller split count: no empty split, no history
# dependence, so experiment 1b cannot see it; experiment S can.
CFG_S = ScenarioConfig(spec=ModelSpec.tiny(num_heads=8).to_dict(), kv_dtype="fp16", q_dtype="fp16", page_size=64,
                       next_n=2, capture_sizes=[4], max_pages_per_seq=8, seed=7, pool_pages=84)
STEPS_S = [{"op": "capture", "size": 4, "batch": _batch(11, [512]), "warmups": 0, "share": False},
           {"op": "replay", "size": 4, "batch": _batch(13, [500]), "poison": False},
           {"op": "replay", "size": 4, "batch": _batch(12, [2]), "poison": False}]


def test_a_replay_reading_an_earlier_replays_leftovers_is_stale_contents():
    assert run_steps(TritonDecodeBackend, CFG_S, STEPS_S, "emulated") is None
    f = run_steps(ExampleUnguardedStage2, CFG_S, STEPS_S, "emulated")
    assert f is not None and f.oracle == "replay-eager" and f.step == 2, f
    as_eager = {"op": "eager", "batch": STEPS_S[2]["batch"], "pad_to": 4, "poison": False}
    assert run_steps(ExampleUnguardedStage2, CFG_S, STEPS_S[:2] + [as_eager], "emulated") is None  # 1b sees nothing
    recaptured = copy.deepcopy(STEPS_S)
    recaptured[0]["batch"] = copy.deepcopy(STEPS_S[2]["batch"])
    assert run_steps(ExampleUnguardedStage2, CFG_S, recaptured, "emulated") is None  # experiment 3 would say laziness
    d = diagnose(ExampleUnguardedStage2, CFG_S, STEPS_S, f, "emulated")
    assert d.cls in EXPECTED["example-unguarded-stage2"], d.explanation
    assert "draw their inputs from other seeds" in d.explanation, d.explanation
    assert "(the forward: harness/mutants/examples.py:" in d.explanation, d.explanation


# The eager-check shape (a shrunk CPU repro, seed 2): the graph, captured for one short row,
# replays right; the eager forward that checks it partitions the long row into more splits than
# the replay wrote, and the short rows' empty splits merge what the replay left there. Only the
# check is wrong, and only after the replay: 1b replaces the replay by an eager step, S varies the
# replay's own inputs, R gives the check a build of its own -- none of them sees it. Experiment E
# sets the replay-eager comparison aside: the check fails the reference; alone it passes.
CFG_E = ScenarioConfig(spec=ModelSpec.tiny(num_heads=1).to_dict(), kv_dtype="fp16", q_dtype="fp16", page_size=4,
                       next_n=1, capture_sizes=[3], max_pages_per_seq=24, seed=0, pool_pages=82)
STEPS_E = [{"op": "capture", "size": 3, "batch": {"seed": 0, "seq_lens": [1], "q_lens": [1], "max_decode_len": 1},
            "warmups": 0, "share": False},
           {"op": "replay", "size": 3, "batch": {"seed": 0, "seq_lens": [1, 1, 95], "q_lens": [1, 1, 1],
                                                 "max_decode_len": 1}, "poison": False}]


def test_an_eager_check_reading_the_replays_leftovers_is_stale_contents():
    from mla_fuzz.harness.executor import ScenarioRunner
    from mla_fuzz.harness.oracles import OracleFailure

    assert run_steps(TritonDecodeBackend, CFG_E, STEPS_E, "emulated") is None
    f = run_steps(ExampleUnguardedStage2, CFG_E, STEPS_E, "emulated")
    assert f is not None and f.oracle == "replay-eager" and f.step == 1, f
    # with the comparison set aside, the reference blames the eager check, not the replay ...
    runner = ScenarioRunner(ExampleUnguardedStage2, CFG_E, "emulated", eager_own_build=True,
                            skip_oracles=("replay-eager",))
    try:
        runner.apply(STEPS_E[0])
        try:
            runner.apply(STEPS_E[1])
            raise AssertionError("the eager check passed the reference")
        except OracleFailure as blamed:
            assert blamed.oracle == "reference" and "eager forward" in blamed.message, blamed
    finally:
        runner.close()
    # ... and the same batch alone passes
    assert run_steps(ExampleUnguardedStage2, CFG_E, [{"op": "eager", "batch": STEPS_E[1]["batch"], "pad_to": 3,
                                                      "poison": False}], "emulated") is None
    d = diagnose(ExampleUnguardedStage2, CFG_E, STEPS_E, f, "emulated")
    assert d.cls in EXPECTED["example-unguarded-stage2"], d.explanation
    assert "the eager forward that checks the replay at step 1 disagrees with the reference" in d.explanation
    assert "(the forward: harness/mutants/examples.py:" in d.explanation, d.explanation


def test_a_split_frozen_at_capture_stays_laziness():
    """A host-side plan frozen into the graph does not depend on what earlier steps computed:
    experiment S leaves it to experiment 3."""
    cfg = ScenarioConfig(spec=ModelSpec.tiny(num_heads=4).to_dict(), page_size=16, next_n=1, capture_sizes=[2],
                         max_pages_per_seq=16, seed=3)
    one = {"seed": 1, "seq_lens": [1, 1], "q_lens": [1, 1], "max_decode_len": 1}  # no split at capture ...
    two = {"seed": 2, "seq_lens": [200, 9], "q_lens": [1, 1], "max_decode_len": 1}  # ... for a row that needs one
    steps = [{"op": "capture", "size": 2, "batch": one, "warmups": 0, "share": False},
             {"op": "replay", "size": 2, "batch": two, "poison": False}]
    f = run_steps(HostSplitDecision, cfg, steps, "emulated")
    assert f is not None and f.oracle == "replay-eager" and f.step == 1, f
    d = diagnose(HostSplitDecision, cfg, steps, f, "emulated")
    assert d.cls in EXPECTED["host-split-decision"], d.explanation
