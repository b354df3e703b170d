"""The fidelity harness: every scenario's oracle under the emulator on the CPU, the
comparator itself, the registry hook, and (GPU) cuda vs emulated, bitwise."""
import sys
import textwrap

import pytest
import torch

from mla_fuzz.harness.graphs import fidelity
from mla_fuzz.harness.graphs.fidelity import (SCENARIOS, all_scenarios, bitwise_equal,
                                     compare_modes, compare_results, run_scenario, scenario)

CPU_SCENARIOS = [s.name for s in all_scenarios("cpu")]
CUDA_SCENARIOS = [s.name for s in all_scenarios("cuda")]


def test_registry_has_at_least_twenty_scenarios_with_oracles():
    assert len(SCENARIOS) >= 20
    ok_ones = [s for s in SCENARIOS.values() if not s.capture_error]
    assert len(ok_ones) >= 20
    for s in ok_ones:
        assert s.build(torch.device("cpu")).expect is not None, s.name


@pytest.mark.parametrize("name", CPU_SCENARIOS)
def test_emulated_scenario_meets_its_oracle(name):
    sc = SCENARIOS[name]
    res = run_scenario(sc, "emulated", "cpu")
    if sc.capture_error:
        assert res.error is not None, f"{name}: capture should have raised CaptureError"
        return
    assert res.error is None, res.error
    assert len(res.rounds) == sc.build(torch.device("cpu")).replays
    assert not res.expect_failures, "\n".join(res.expect_failures)


def test_comparator_flags_semantic_differences():
    # Eager re-runs Python, so it sees rebinding and re-plans: it must NOT look faithful.
    for name in ("rebind_attribute_stale", "python_scalar_baked", "host_branch_frozen"):
        rep = compare_modes(SCENARIOS[name], "cpu", modes=("eager", "emulated"))
        assert not rep.ok and any("differs" in d for d in rep.differences), name
    # ...but agrees where no graph semantics are involved.
    assert compare_modes(SCENARIOS["inplace_input_seen"], "cpu", modes=("eager", "emulated")).ok
    # A capture verdict mismatch is reported too.
    a = run_scenario(SCENARIOS["host_read_item"], "eager", "cpu")
    b = run_scenario(SCENARIOS["host_read_item"], "emulated", "cpu")
    rep = compare_results(a, b)
    assert not rep.ok and "capture verdict" in rep.differences[0]


def test_bitwise_equal_semantics():
    nan = float("nan")
    assert bitwise_equal(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert not bitwise_equal(torch.tensor([1, 2]), torch.tensor([[1, 2]]))
    assert bitwise_equal(torch.tensor(3), torch.tensor(3))


def test_scenario_registry_hook(tmp_path, monkeypatch):
    mod = tmp_path / "extra_fidelity_scenarios.py"
    mod.write_text(textwrap.dedent('''
        import torch
        from mla_fuzz.harness.graphs.fidelity import ScenarioRun, scenario

        @scenario(description="added from outside")
        def extra_outside_scenario(device):
            x = torch.ones(2, device=device)
            return ScenarioRun(fn=lambda: x + 1, between=lambda i, o: x.add_(1),
                               expect=lambda i: [torch.ones(2) + i + 2])
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MLA_FUZZ_FIDELITY_MODULES", "extra_fidelity_scenarios")
    try:
        names = [s.name for s in all_scenarios("cpu")]
        assert "extra_outside_scenario" in names
        res = run_scenario(SCENARIOS["extra_outside_scenario"], "emulated", "cpu")
        assert res.error is None and not res.expect_failures
        with pytest.raises(ValueError, match="already registered"):
            scenario(name="extra_outside_scenario")(lambda d: None)
    finally:
        SCENARIOS.pop("extra_outside_scenario", None)
        sys.modules.pop("extra_fidelity_scenarios", None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_SCENARIOS)
def test_cuda_and_emulated_agree_bitwise(name):
    sc = SCENARIOS[name]
    cuda_res = run_scenario(sc, "cuda", "cuda")
    emu_res = run_scenario(sc, "emulated", "cuda")
    if sc.capture_error:
        assert cuda_res.error is not None and emu_res.error is not None
        return
    assert cuda_res.error is None, cuda_res.error
    assert not cuda_res.expect_failures, "\n".join(cuda_res.expect_failures)
    rep = fidelity.compare_results(cuda_res, emu_res)
    assert rep.ok, "\n".join(rep.differences)
