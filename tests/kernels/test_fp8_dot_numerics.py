"""benchmarks/fp8_dot_numerics.py: the pieces of its emulation of FP8 tensor-core dots (CPU), and
its GPU probe."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz.mla_ref import ModelSpec

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
@given(terms=st.lists(st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False), min_size=1, max_size=40),
       bits=st.integers(1, 23))
def test_align_truncate_cuts_every_addend_below_the_largest_ones_bits(load_benchmark, terms, bits):
    """Each addend becomes the multiple of ``2**(e - bits)`` nearest it toward zero, ``e`` the
    largest addend's exponent: the largest keeps its top ``bits + 1`` bits, and an addend
    ``2**-bits`` of it survives where half of that would not."""
    fd = load_benchmark("fp8_dot_numerics")
    t = torch.tensor(terms, dtype=torch.float64)
    got = fd.align_truncate(t[None], bits)[0]
    big = t.abs().max().item()
    if big == 0:
        assert bool((got == 0).all())
        return
    step = 2.0 ** (math.floor(math.log2(big)) - bits)
    for x, y in zip(t.tolist(), got.tolist()):
        assert (y / step).is_integer() and abs(y) <= abs(x) and abs(x - y) < step
        assert y == 0 or math.copysign(1, y) == math.copysign(1, x)
    lead = 2.0 ** math.floor(math.log2(big))
    kept = fd.align_truncate(torch.tensor([[lead, lead * 2.0 ** -bits, lead * 2.0 ** -(bits + 1)]],
                                          dtype=torch.float64), bits)[0].tolist()
    assert kept == [lead, lead * 2.0 ** -bits, 0.0]


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


def test_narrow_dot_sums_as_its_mode_says(load_benchmark):
    """``exact`` is the plain product; ``promoted`` loses a small product only inside its own
    chunk of 32, ``tensor_core`` also against the running sum of earlier chunks."""
    fd = load_benchmark("fp8_dot_numerics")
    g = torch.Generator().manual_seed(0)
    # integers whose sums stay below 2**24: every fp32 sum is exact, in any order
    a = torch.randint(-8, 8, (3, 96), generator=g).float()
    b = torch.randint(-8, 8, (96, 5), generator=g).float() * 1024.0 + 1.0
    assert torch.equal(fd.narrow_dot(a, b, "exact"), a @ b)
    # one big product in chunk 0, one 2**-14 of it in chunk 1: kept when promoted, lost otherwise
    a = torch.zeros(1, 64)
    b = torch.zeros(64, 1)
    a[0, 0], b[0, 0], a[0, 32], b[32, 0] = 16.0, 16.0, 2.0 ** -3, 2.0 ** -3
    for mode, want in (("exact", 256 + 2.0 ** -6), ("promoted", 256 + 2.0 ** -6), ("tensor_core", 256.0)):
        assert fd.narrow_dot(a, b, mode, bits=13).item() == want, mode
    # the same two products in one chunk: lost in both narrow modes
    a[0, 32], b[32, 0], a[0, 1], b[1, 0] = 0.0, 0.0, 2.0 ** -3, 2.0 ** -3
    assert fd.narrow_dot(a, b, "promoted", bits=13).item() == 256.0
    with pytest.raises(ValueError, match="mode must be one of"):
        fd.narrow_dot(a, b, "fast")


@pytest.mark.parametrize("dist", ["normal", "big_q"])
def test_both_paths_are_within_the_gpu_tolerance_with_exact_sums(load_benchmark, dist):
    """With exact sums the shipped numerics and the hi + lo FP8 dots both stay well inside bf16's
    GPU tolerance; the errors are real (not zero)."""
    fd = load_benchmark("fp8_dot_numerics")
    spec = ModelSpec(num_heads=4)
    q, packed = fd.make_inputs(4, 128, dist, torch.Generator().manual_seed(2), spec)
    outs = fd.run_paths(q, packed, spec, "exact")
    for path in ("shipped", "fp8_dots"):
        e = fd.errors(outs[path], outs["reference"])
        assert 0 < e["tol_ratio"] < 0.5, (path, e)


def test_bad_arguments_are_usage_errors(load_benchmark):
    fd = load_benchmark("fp8_dot_numerics")
    for argv in (["--length", "100"], ["--modes", "fast"], ["--bits", "30"], ["--dists", "uniform"]):
        with pytest.raises(SystemExit):
            fd.main(argv + ["--seeds", "1"])


@pytest.mark.gpu
def test_the_accumulation_probe_sees_close_products_whole_gpu(load_benchmark):
    """On the GPU: a product 8 bits below the large one reaches the result whole in either
    mode and chunk, and no row reports more than the whole product or less than none."""
    fd = load_benchmark("fp8_dot_numerics")
    for fast in (True, False):
        res = fd.probe_accumulation(fast_accum=fast)
        assert set(res) == {"within", "across"}
        for where, rows in res.items():
            assert [r for r, _ in rows] == list(range(8, 24))
            assert rows[0][1] == 1.0, (fast, where, rows[0])
            assert all(-1e-6 <= kept <= 1.0 + 1e-6 for _, kept in rows), (fast, where, rows)
