"""Graph semantics on the real Triton backend: replay == eager when metadata is rebuilt
in place, stale when it is rebound, frozen when planning was lazy or host-decided — on
the CPU emulator here, and identically under real CUDA graphs (gpu)."""
import pytest
import torch

from mla_fuzz.harness.fidelity_backend import TRITON_SCENARIOS
from mla_fuzz.harness.graphs.fidelity import SCENARIOS, compare_modes, run_scenario


@pytest.mark.parametrize("name", TRITON_SCENARIOS)
def test_triton_scenario_meets_its_oracle_emulated(name):
    sc = SCENARIOS[name]
    res = run_scenario(sc, "emulated", "cpu")
    if sc.capture_error:
        assert res.error is not None, f"{name}: capture should have raised CaptureError"
        return
    assert res.error is None, res.error
    assert not res.expect_failures, "\n".join(res.expect_failures)


def test_rebound_metadata_really_differs_from_eager_of_new_batch():
    """The stale scenario is not vacuous: the replay differs from an eager forward of the
    new batch (it computes the capture-time batch instead)."""
    from mla_fuzz.harness.fidelity_backend import _ROUNDS, _draw, _Engine
    from mla_fuzz.harness.graphs import make_runner

    eng = _Engine("cpu", graph_safe=False)
    eng.step(_draw(1, [70, 3]))
    graph = make_runner("emulated", "cpu").capture(eng.graph_fn())
    try:
        eng.step(_ROUNDS[0])
        stale = [t.clone() for t in graph.replay()]
        fresh = eng.forward_with(eng.md)
        assert not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(stale, fresh))
    finally:
        graph.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRITON_SCENARIOS)
def test_triton_cuda_and_emulated_agree_bitwise(name):
    rep = compare_modes(SCENARIOS[name], "cuda", modes=("cuda", "emulated"))
    assert rep.ok, "\n".join(rep.differences)
