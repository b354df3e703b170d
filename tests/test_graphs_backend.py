"""Graph semantics on the real Triton backend: replay == eager when metadata is rebuilt
in place, stale when it is rebound, frozen when planning was lazy or host-decided — on
the CPU emulator here, and identically under real CUDA graphs (gpu)."""
import pytest
import torch

from harness.fidelity_backend import TRITON_SCENARIOS
from harness.graphs.fidelity import SCENARIOS, compare_modes, run_scenario


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
    """The stale scenario is not vacuous: eager of the new batch differs from the replay."""
    sc = SCENARIOS["triton_rebound_metadata_stale"]
    stale = run_scenario(sc, "emulated", "cpu")
    eager = run_scenario(sc, "eager", "cpu")
    assert stale.error is None and eager.error is None
    differs = [not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for ra, rb in zip(stale.rounds, eager.rounds) for a, b in zip(ra, rb)]
    assert any(differs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRITON_SCENARIOS)
def test_triton_cuda_and_emulated_agree_bitwise(name):
    rep = compare_modes(SCENARIOS[name], "cuda", modes=("cuda", "emulated"))
    assert rep.ok, "\n".join(rep.differences)
