"""The cache-write kernel against mla_ref.write_kv_cache: bitwise, slot -1 untouched."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import ModelSpec

from mla_fuzz.kernels import ops

SPEC = ModelSpec.tiny()


def _write_both(spec, kv_dtype, latent, rope, slots, num_blocks, page, device="cpu", k_scale=2.0 ** -5):
    """The same write through the reference and the kernel, on NaN-poisoned caches (an
    fp8_e4m3 cache with ``k_scale``, an fp32 ``[1]`` tensor on ``device``)."""
    ref = mla_ref.make_kv_cache(spec, num_blocks, page, kv_dtype, fill=float("nan"), device=device)
    out = ref.clone()
    before = ref.clone()
    ks = torch.tensor([k_scale], dtype=torch.float32, device=device) if kv_dtype == "fp8_e4m3" else None
    mla_ref.write_kv_cache(ref, latent, rope, slots, spec=spec, k_scale=ks)
    ops.write_kv_cache(out, latent, rope, slots, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group,
                       k_scale=ks)
    return before, ref, out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_dtype=st.sampled_from(["bf16", "fp16", "fp8", "fp8_e4m3"]),
       in_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       T=st.integers(0, 40), page=st.sampled_from([1, 4, 16]), data=st.data())
def test_cache_write_matches_reference_bitwise(kv_dtype, in_dtype, T, page, data):
    """(fp8_e4m3 at k_scale 2**-5: the magnitudes below reach past 448 * k_scale -- saturation --
    and below the subnormal step.)"""
    num_blocks = max(2, -(-T // page) + 1)
    n_slots = num_blocks * page
    chosen = data.draw(st.lists(st.integers(0, n_slots - 1), min_size=T, max_size=T, unique=True)) if T <= n_slots else []
    T = len(chosen)
    skip = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    slots = torch.tensor([-1 if s else c for c, s in zip(chosen, skip)], dtype=torch.int64)
    seed = data.draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, whole zero groups, and NaN rows for skipped tokens
    mag = torch.logspace(-6, 3, max(T, 1))[torch.randperm(max(T, 1), generator=g)][:T, None]
    latent = torch.randn(T, SPEC.kv_lora_rank, generator=g) * mag
    if T:
        latent[0, :SPEC.fp8_group] = 0
    rope = torch.randn(T, SPEC.qk_rope_head_dim, generator=g)
    latent[slots < 0] = float("nan")
    rope[slots < 0] = float("nan")
    latent, rope = latent.to(in_dtype), rope.to(in_dtype)
    before, ref, out = _write_both(SPEC, kv_dtype, latent, rope, slots, num_blocks, page)
    assert torch.equal(_bytes(out), _bytes(ref)), "kernel bytes differ from the reference write"
    # and independently of the reference: slots not written are bitwise unchanged
    flat_before = _bytes(before).reshape(n_slots, -1)
    flat_out = _bytes(out).reshape(n_slots, -1)
    written = set(slots[slots >= 0].tolist())
    untouched = [s for s in range(n_slots) if s not in written]
    assert torch.equal(flat_out[untouched], flat_before[untouched])


def test_cache_write_fp8_roundtrip_bound():
    """Dequantised values are within half an e4m3 step (2**-4 relative) of the input per group."""
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(5, SPEC.kv_lora_rank, generator=g) * 3
    rope = torch.randn(5, SPEC.qk_rope_head_dim, generator=g).to(torch.bfloat16).float()
    cache = mla_ref.make_kv_cache(SPEC, 2, 4, "fp8")
    ops.write_kv_cache(cache, latent, rope, torch.arange(5, dtype=torch.int64), SPEC.kv_lora_rank,
                       SPEC.qk_rope_head_dim, SPEC.fp8_group)
    back = mla_ref.dequantize_kv_fp8(cache.reshape(-1, SPEC.fp8_bytes_per_token)[:5], spec=SPEC)
    groups = latent.reshape(5, -1, SPEC.fp8_group)
    amax = groups.abs().amax(-1, keepdim=True)
    err = (back[:, :SPEC.kv_lora_rank].reshape_as(groups) - groups).abs()
    assert (err <= amax * 2 ** -4 + 1e-30).all()
    assert torch.equal(back[:, SPEC.kv_lora_rank:], rope)


def test_cache_write_rejects_bad_arguments():
    cache = mla_ref.make_kv_cache(SPEC, 2, 4, "bf16")
    lat = torch.zeros(3, SPEC.kv_lora_rank)
    rope = torch.zeros(3, SPEC.qk_rope_head_dim)
    slots = torch.arange(3)
    args = (SPEC.kv_lora_rank, SPEC.qk_rope_head_dim, SPEC.fp8_group)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.write_kv_cache(cache, lat, rope, slots.int(), *args)
    with pytest.raises(ValueError, match="latent must be contiguous"):
        ops.write_kv_cache(cache, torch.zeros(SPEC.kv_lora_rank, 3).t(), rope, slots, *args)
    with pytest.raises(ValueError, match="rope"):
        ops.write_kv_cache(cache, lat, rope[:2], slots, *args)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        ops.write_kv_cache(mla_ref.make_kv_cache(SPEC, 4, 4, "bf16")[::2], lat, rope, slots, *args)
    with pytest.raises(ValueError, match="fp8_bytes_per_token"):
        ops.write_kv_cache(torch.zeros(2, 4, 100, dtype=torch.uint8), lat, rope, slots, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "fp8_e4m3"])
def test_cache_write_matches_reference_gpu(kv_dtype):
    spec = ModelSpec()
    g = torch.Generator().manual_seed(3)
    T, page, num_blocks = 300, 64, 8
    slots = torch.randperm(num_blocks * page, generator=g)[:T]
    slots[::7] = -1
    latent = (torch.randn(T, spec.kv_lora_rank, generator=g) * torch.logspace(-5, 3, T)[:, None]).to(torch.bfloat16)
    rope = torch.randn(T, spec.qk_rope_head_dim, generator=g).to(torch.bfloat16)
    scale = {}
    if kv_dtype == "fp8_e4m3":  # infinities saturate; an inexact scale (IEEE division, round-half-even)
        latent[0, :2] = torch.tensor([float("inf"), float("-inf")]).to(torch.bfloat16)
        scale = {"k_scale": 0.0173}
    before, ref, out = _write_both(spec, kv_dtype, latent.cuda(), rope.cuda(), slots.cuda(), num_blocks, page,
                                   device="cuda", **scale)
    assert torch.equal(_bytes(out), _bytes(ref))
