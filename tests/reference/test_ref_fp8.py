"""The FP8 token format: byte layout, round-trip error bound, poisoning."""
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_fuzz.mla_ref import ModelSpec, dequantize_kv_fp8, make_kv_cache, quantize_kv_fp8, split_fp8_tokens
from ref_cases import MICRO, SMALL_SPECS

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=40)


def test_deepseek_token_is_656_bytes():
    spec = ModelSpec.deepseek_v3()
    packed = quantize_kv_fp8(torch.randn(3, 512), torch.randn(3, 64), spec=spec)
    assert spec.fp8_bytes_per_token == 656
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 656)


def test_byte_layout_matches_hand_encoding():
    """Bytes checked against encodings worked out by hand (e4m3fn: 1 sign, 4 exponent bits
    with bias 7, 3 mantissa bits) and Python's struct for the little-endian fp32 scales."""
    spec = MICRO  # rank 32 in two groups of 16, rope 8
    latent = torch.zeros(32)
    latent[:3] = torch.tensor([2.0, -1.0, 0.5])  # group 0 amax 2 -> scaled to 448, -224, 112
    rope = torch.tensor([1.0, -2.0, 0, 0, 0, 0, 0, 0])
    packed = quantize_kv_fp8(latent, rope, spec=spec).tolist()
    assert len(packed) == 32 + 2 * 4 + 8 * 2
    # 448 = 1.75*2^8 -> 0 1111 110; -224 = -1.75*2^7 -> 1 1110 110; 112 = 1.75*2^6 -> 0 1101 110
    assert packed[:3] == [0x7E, 0xF6, 0x6E]
    assert packed[3:32] == [0] * 29
    assert bytes(packed[32:36]) == struct.pack("<f", 2.0 / 448.0)
    # an all-zero group still gets a finite normal scale (the amax floor 2^-100)
    assert bytes(packed[36:40]) == struct.pack("<f", 2.0 ** -100 / 448.0)
    # bf16 1.0 = 0x3F80, -2.0 = 0xC000, little-endian
    assert packed[40:44] == [0x80, 0x3F, 0x00, 0xC0]
    assert packed[44:] == [0] * 12


@SETTINGS
@given(spec=st.sampled_from(SMALL_SPECS + [ModelSpec.deepseek_v3()]), n=st.integers(1, 6),
       log_mag=st.integers(-30, 30), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_roundtrip_error_within_e4m3_bound(spec, n, log_mag, dtype, seed):
    """Per element |deq - x| <= 2^-4 |x| + 2^-10 s (s = group amax / 448), hence <= 2^-4 amax.

    Why: y = x/s lies in [-448, 448]. e4m3 keeps 3 mantissa bits, so for a normal y
    (|y| >= 2^-6) in binade [2^e, 2^(e+1)) the spacing is 2^(e-3) and round-to-nearest is off
    by at most 2^(e-4) <= 2^-4 |y|; below 2^-6 the subnormal spacing is 2^-9, so the error is
    at most 2^-10. Multiplying back by s gives the bound; the fp32 division, the clamp at 448
    and the fp32 product each add at most a few 2^-24 relative, covered by the 2^-20 slack.
    """
    gen = torch.Generator().manual_seed(seed)
    # heavy-tailed values over a wide range so groups hold both normal and subnormal codes
    x = (torch.randn(n, spec.kv_lora_rank, generator=gen, dtype=torch.float64)
         * torch.exp(3 * torch.randn(n, spec.kv_lora_rank, generator=gen, dtype=torch.float64))
         * 2.0 ** log_mag).to(dtype)
    rope = torch.randn(n, spec.qk_rope_head_dim, generator=gen).to(dtype)
    deq = dequantize_kv_fp8(quantize_kv_fp8(x, rope, spec=spec), spec=spec, dtype=torch.float64)
    xf = x.to(torch.float64)
    groups = xf.view(n, -1, spec.fp8_group)
    s = (groups.abs().amax(-1, keepdim=True) / 448.0).expand_as(groups).reshape(n, -1)
    err = (deq[:, :spec.kv_lora_rank] - xf).abs()
    bound = (2.0 ** -4 + 2.0 ** -20) * xf.abs() + (2.0 ** -10 + 2.0 ** -20) * s
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((err <= 2.0 ** -4 * (1 + 2.0 ** -10) * 448 * s).all())
    # rope is stored as bf16: exactly rope rounded to bf16
    assert torch.equal(deq[:, spec.kv_lora_rank:], rope.to(torch.bfloat16).to(torch.float64))


@SETTINGS
@given(spec=st.sampled_from(SMALL_SPECS), seed=st.integers(0, 2 ** 31 - 1))
def test_scales_are_group_amax_over_448(spec, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, spec.kv_lora_rank, generator=gen) * torch.rand(4, spec.kv_lora_rank // spec.fp8_group, 1,
                                                                          generator=gen).repeat_interleave(
                                                                              spec.fp8_group, dim=1).view(4, -1) * 10
    values, scales, rope = split_fp8_tokens(quantize_kv_fp8(x, torch.zeros(4, spec.qk_rope_head_dim), spec=spec),
                                            spec=spec)
    expect = x.view(4, -1, spec.fp8_group).abs().amax(-1) / 448.0
    torch.testing.assert_close(scales, expect, rtol=2.0 ** -23, atol=0)
    # each group's largest element lands on the top code
    top = values.to(torch.float32).view(4, -1, spec.fp8_group).abs().amax(-1)
    assert bool((top == 448.0).all())


def test_zero_tokens_roundtrip_exactly():
    spec = ModelSpec.tiny()
    deq = dequantize_kv_fp8(quantize_kv_fp8(torch.zeros(2, 64), torch.zeros(2, 16), spec=spec), spec=spec)
    assert torch.equal(deq, torch.zeros(2, spec.d_qk))


def test_leading_dims_and_empty_batches_keep_their_shape():
    spec = MICRO
    packed = quantize_kv_fp8(torch.randn(2, 3, 32), torch.randn(2, 3, 8), spec=spec)
    assert tuple(packed.shape) == (2, 3, spec.fp8_bytes_per_token)
    assert tuple(dequantize_kv_fp8(packed, spec=spec).shape) == (2, 3, spec.d_qk)
    empty = quantize_kv_fp8(torch.randn(0, 32), torch.randn(0, 8), spec=spec)
    assert tuple(dequantize_kv_fp8(empty, spec=spec).shape) == (0, spec.d_qk)


def test_nan_filled_fp8_cache_reads_back_as_nan():
    """Poisoning an FP8 cache must poison every value it decodes to (the harness relies on it)."""
    spec = MICRO
    cache = make_kv_cache(spec, 2, 4, "fp8", fill=float("nan"))
    assert tuple(cache.shape) == (2, 4, spec.fp8_bytes_per_token)
    assert bool(dequantize_kv_fp8(cache, spec=spec).isnan().all())


def test_dequantize_in_fp64_is_exact_product():
    """In fp64 the e4m3 (4 significant bits) x fp32 scale (24 bits) product is exact."""
    spec = MICRO
    packed = quantize_kv_fp8(torch.randn(5, 32) * 3, torch.randn(5, 8), spec=spec)
    values, scales, _ = split_fp8_tokens(packed, spec=spec)
    deq = dequantize_kv_fp8(packed, spec=spec, dtype=torch.float64)
    exact = values.to(torch.float64).view(5, 2, 16) * scales.to(torch.float64).unsqueeze(-1)
    assert torch.equal(deq[:, :32], exact.view(5, 32))


@pytest.mark.parametrize("call, arg", [
    (lambda s: quantize_kv_fp8(torch.randn(2, 31), torch.randn(2, 8), spec=s), "latent"),
    (lambda s: quantize_kv_fp8(torch.randn(2, 32), torch.randn(2, 6), spec=s), "rope"),
    (lambda s: quantize_kv_fp8(torch.randn(2, 32), torch.randn(3, 8), spec=s), "rope"),
    (lambda s: quantize_kv_fp8(torch.ones(2, 32, dtype=torch.int32), torch.randn(2, 8), spec=s), "latent"),
    (lambda s: dequantize_kv_fp8(torch.zeros(2, 10, dtype=torch.uint8), spec=s), "packed"),
    (lambda s: dequantize_kv_fp8(torch.zeros(2, 56, dtype=torch.int8), spec=s), "packed"),
])
def test_fp8_bad_input_names_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call(MICRO)
