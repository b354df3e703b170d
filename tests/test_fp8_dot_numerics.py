"""benchmarks/fp8_dot_numerics.py: the pieces of its emulation of FP8 tensor-core dots, and its
reference against the project's oracle (CPU)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_ref
from mla_ref import ModelSpec

_FIXTURE = [HealthCheck.function_scoped_fixture]  # the loader holds no state between examples


@settings(max_examples=200, suppress_health_check=_FIXTURE)
@given(mag=st.floats(0.25, 255.0), sign=st.sampled_from([-1.0, 1.0]))
def test_split_e4m3_is_exact_for_bf16_values_in_range(load_benchmark, mag, sign):
    """A bf16 value (8 significant bits) in [0.25, 256) is exactly hi + lo: hi keeps 4 bits, the
    rest has at most 4 and lies above e4m3's smallest step (2**-9)."""
    fd = load_benchmark("fp8_dot_numerics")
    x = torch.tensor([sign * mag]).to(torch.bfloat16).float()
    hi, lo = fd.split_e4m3(x)
    assert hi.dtype == lo.dtype == torch.float8_e4m3fn
    assert (hi.float() + lo.float()).item() == x.item()


@settings(max_examples=200, suppress_health_check=_FIXTURE)
@given(x=st.floats(-1e30, 1e30, allow_nan=False, allow_subnormal=False).filter(lambda v: abs(v) > 1e-30),
       bits=st.integers(1, 23))
def test_round_mantissa_drops_low_bits_toward_zero(load_benchmark, x, bits):
    fd = load_benchmark("fp8_dot_numerics")
    t = torch.tensor([x], dtype=torch.float32)
    r = fd.round_mantissa(t, bits).item()
    v = t.item()
    if bits == 23:
        assert r == v
    assert abs(r) <= abs(v) and (r == 0 or math.copysign(1, r) == math.copysign(1, v))
    assert abs(v - r) < 2.0 ** -bits * abs(v)
    m, _ = math.frexp(r)  # r keeps at most bits + 1 significant bits
    assert (m * 2 ** (bits + 1)).is_integer()


@settings(max_examples=100, suppress_health_check=_FIXTURE)
@given(amax=st.floats(1e-30, 1e30), limit=st.sampled_from([256.0, 2.0 ** 15]))
def test_pow2_under_is_the_largest_power_of_two_that_fits(load_benchmark, amax, limit):
    fd = load_benchmark("fp8_dot_numerics")
    f = fd.pow2_under(torch.tensor([amax], dtype=torch.float32), limit)
    a = torch.tensor([amax], dtype=torch.float32).item()
    k = math.log2(f.item())
    assert k.is_integer() and -126 <= k <= 126
    assert a * f.item() <= limit
    assert k == 126 or a * f.item() * 2 > limit


def test_pow2_under_leaves_zero_and_non_finite_alone(load_benchmark):
    fd = load_benchmark("fp8_dot_numerics")
    f = fd.pow2_under(torch.tensor([0.0, float("inf"), float("nan"), 1e-44]), 256.0)
    assert f[:3].tolist() == [1.0, 1.0, 1.0] and f[3].item() == 2.0 ** 126


def test_narrow_dot_is_exact_at_23_bits_and_narrows_below(load_benchmark):
    fd = load_benchmark("fp8_dot_numerics")
    g = torch.Generator().manual_seed(0)
    # integers whose sums stay below 2**24: every fp32 sum is exact, in any order
    a = torch.randint(-8, 8, (3, 96), generator=g).float()
    b = torch.randint(-8, 8, (96, 5), generator=g).float() * 1024.0 + 1.0
    assert torch.equal(fd.narrow_dot(a, b, 23), a @ b)
    # positive terms (no cancellation): three chunk additions, each cut by less than 2**-4 of a
    # total no larger than the final one, all toward zero
    a, b = a.abs() + 1, b.abs()
    exact, narrow = a @ b, fd.narrow_dot(a, b, 4)
    assert not torch.equal(narrow, exact)
    assert ((narrow <= exact) & (exact - narrow < 3 * 2.0 ** -4 * exact)).all()


def test_the_reference_path_is_the_oracles_decode(load_benchmark):
    """Its fp64 reference is ``mla_ref.mla_decode`` on the same cache tokens (one request, one
    page holding them all, q in fp64)."""
    fd = load_benchmark("fp8_dot_numerics")
    spec = ModelSpec(num_heads=4)
    q, packed = fd.make_inputs(4, 128, "outliers", torch.Generator().manual_seed(1), spec)
    outs = fd.run_paths(q, packed, spec, 23)
    want, _ = mla_ref.mla_decode(q.double()[None, None], packed[None], torch.zeros(1, 1, dtype=torch.int32),
                                 torch.tensor([128], dtype=torch.int32), spec=spec)
    torch.testing.assert_close(outs["reference"], want[0, 0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dist", ["normal", "big_q"])
def test_both_paths_are_within_the_gpu_tolerance_with_exact_sums(load_benchmark, dist):
    """With exact accumulation the shipped numerics and the hi + lo FP8 dots both stay well inside
    bf16's GPU tolerance; the errors are real (not zero)."""
    fd = load_benchmark("fp8_dot_numerics")
    spec = ModelSpec(num_heads=4)
    q, packed = fd.make_inputs(4, 128, dist, torch.Generator().manual_seed(2), spec)
    outs = fd.run_paths(q, packed, spec, 23)
    for path in ("shipped", "fp8_dots"):
        e = fd.errors(outs[path], outs["reference"])
        assert 0 < e["tol_ratio"] < 0.5, (path, e)


def test_bad_arguments_are_usage_errors(load_benchmark):
    fd = load_benchmark("fp8_dot_numerics")
    for argv in (["--length", "100"], ["--acc-bits", "x"], ["--acc-bits", "30"], ["--dists", "uniform"]):
        with pytest.raises(SystemExit):
            fd.main(argv + ["--seeds", "1"])
