"""Diagnosis experiment (R): a forward that changes its own build. The eager forward that
checks a replay runs on the replay's build, after it; given a build of its own it agrees with
the replay, so the forward changed what a second forward on one build reads: layer-state. The
same for an eager forward run twice (the determinism oracle)."""
from __future__ import annotations

from mla_fuzz.harness.diagnosis import diagnose
from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.mutants import ContextLensInPlace, TileCounterPerBuild
from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.kernels import TritonMLABackend
from mla_fuzz.mla_ref import ModelSpec

CFG = ScenarioConfig(spec=ModelSpec.tiny(num_heads=4).to_dict(), page_size=4, next_n=1, capture_sizes=[2],
                     max_pages_per_seq=8, seed=3)


def _batch(seed, seq_lens):
    return {"seed": seed, "seq_lens": seq_lens, "q_lens": [1] * len(seq_lens), "max_decode_len": 1}


STEPS = [{"op": "capture", "size": 2, "batch": _batch(1, [9, 5]), "warmups": 0, "share": False},
         {"op": "replay", "size": 2, "batch": _batch(2, [20, 13]), "poison": False}]


def test_a_forward_that_changes_its_build_is_layer_state():
    f = run_steps(ContextLensInPlace, CFG, STEPS, "emulated")
    assert f is not None and f.oracle == "replay-eager" and f.step == 1
    # the replay is right: the eager check on a build of its own agrees with it
    assert run_steps(ContextLensInPlace, CFG, STEPS, "emulated", eager_own_build=True) is None
    d = diagnose(ContextLensInPlace, CFG, STEPS, f, "emulated")
    assert d.cls == "layer-state" and "second forward on the same build" in d.explanation
    # it names the field the forward changed, as the backend's author calls it
    assert "metadata field(s) seq_lens no longer hold what build() writes" in d.explanation, d.explanation
    assert "(the forward: harness/mutants/build_state.py:" in d.explanation, d.explanation  # the author's line


def test_the_clean_backend_passes_with_the_check_on_either_build():
    assert run_steps(TritonMLABackend, CFG, STEPS, "emulated") is None
    assert run_steps(TritonMLABackend, CFG, STEPS, "emulated", eager_own_build=True) is None


EAGER_ONLY = [{"op": "eager", "batch": _batch(4, [17, 6]), "pad_to": 2, "poison": False}]


def test_a_forward_that_changes_its_build_seen_by_an_eager_forward_run_twice():
    """The same bug with no graph: an eager step's determinism oracle runs the forward a
    second time on the same build. Given a build of its own the second run agrees, so it is
    layer-state (before: numerical, "no graph or padding involved"), naming the field."""
    f = run_steps(TileCounterPerBuild, CFG, EAGER_ONLY, "emulated")
    assert f is not None and f.oracle == "determinism" and f.step == 0
    assert run_steps(TileCounterPerBuild, CFG, EAGER_ONLY, "emulated", eager_own_build=True) is None
    d = diagnose(TileCounterPerBuild, CFG, EAGER_ONLY, f, "emulated")
    assert d.cls == "layer-state" and "run a second time on the same build" in d.explanation, d.explanation
    assert "metadata field(s) tiles_taken no longer hold what build() writes" in d.explanation, d.explanation
    assert "(the forward: harness/mutants/build_state.py:" in d.explanation, d.explanation
    assert run_steps(TritonMLABackend, CFG, EAGER_ONLY, "emulated", eager_own_build=True) is None
