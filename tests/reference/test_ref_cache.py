"""Paged cache: allocation, writes by slot mapping (-1 skipped), explicit page gathers."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_fuzz.mla_ref import ModelSpec, dequantize_kv_fp8, gather_kv, make_kv_cache, quantize_kv_fp8, write_kv_cache
from ref_cases import MICRO, SMALL_SPECS

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=40)


@pytest.mark.parametrize("kv_dtype, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("fp32", torch.float32), ("fp8", torch.uint8)])
def test_make_kv_cache_layouts(kv_dtype, dtype):
    spec = ModelSpec.deepseek_v3()
    cache = make_kv_cache(spec, 3, 64, kv_dtype)
    want = (3, 64, 656) if kv_dtype == "fp8" else (3, 64, 1, 576)
    assert cache.dtype == dtype and tuple(cache.shape) == want
    assert not bool(cache.any())
    read = gather_kv(cache, torch.tensor([2, 0], dtype=torch.int32), 100, spec=spec)
    assert read.dtype == torch.float32 and torch.equal(read, torch.zeros(100, 576))


def test_make_kv_cache_fill_reads_back():
    spec = MICRO
    for kv_dtype in ("bf16", "fp16", "fp8"):
        cache = make_kv_cache(spec, 2, 3, kv_dtype, fill=1.5)
        read = gather_kv(cache, torch.tensor([1, 0], dtype=torch.int32), 6, spec=spec)
        assert torch.equal(read, torch.full((6, spec.d_qk), 1.5)), kv_dtype


@SETTINGS
@given(spec=st.sampled_from(SMALL_SPECS), kv_dtype=st.sampled_from(["bf16", "fp16", "fp32", "fp8"]),
       num_blocks=st.integers(1, 6), page_size=st.sampled_from([1, 2, 5, 16]), data=st.data())
def test_write_lands_at_its_slot_and_nowhere_else(spec, kv_dtype, num_blocks, page_size, data):
    n_slots = num_blocks * page_size
    slots = data.draw(st.lists(st.integers(0, n_slots - 1), unique=True, max_size=min(n_slots, 12)))
    # -1 (skip) entries interleaved with the real writes
    skips = data.draw(st.lists(st.integers(0, len(slots)), max_size=4))
    mapping = list(slots)
    for pos in sorted(skips, reverse=True):
        mapping.insert(pos, -1)
    T = len(mapping)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    latent = torch.randn(T, spec.kv_lora_rank, generator=gen)
    rope = torch.randn(T, spec.qk_rope_head_dim, generator=gen)
    cache = make_kv_cache(spec, num_blocks, page_size, kv_dtype, fill=float("nan"))
    before = cache.clone()
    write_kv_cache(cache, latent, rope, torch.tensor(mapping, dtype=torch.int64), spec=spec)

    flat_before = before.reshape(n_slots, -1)
    flat = cache.reshape(n_slots, -1)
    written = set()
    for t, slot in enumerate(mapping):
        if slot < 0:
            continue
        written.add(slot)
        if kv_dtype == "fp8":
            assert torch.equal(flat[slot], quantize_kv_fp8(latent[t], rope[t], spec=spec))
        else:
            assert torch.equal(flat[slot], torch.cat([latent[t], rope[t]]).to(cache.dtype))
    for slot in range(n_slots):
        if slot not in written:
            # compared as bytes: NaN != NaN, and the poison must survive bit for bit
            assert torch.equal(flat[slot].view(torch.uint8), flat_before[slot].view(torch.uint8)), \
                f"slot {slot} was not written but changed"


@SETTINGS
@given(spec=st.sampled_from(SMALL_SPECS), kv_dtype=st.sampled_from(["bf16", "fp32", "fp8"]),
       page_size=st.sampled_from([1, 3, 8]), seq_len=st.integers(0, 30), seed=st.integers(0, 2 ** 31 - 1))
def test_gather_follows_block_table_and_ignores_unused_columns(spec, kv_dtype, page_size, seq_len, seed):
    gen = torch.Generator().manual_seed(seed)
    n_pages = -(-seq_len // page_size)
    num_blocks = n_pages + 2
    pages = torch.randperm(num_blocks, generator=gen)[:n_pages]
    # garbage (out of range) in the columns the row does not need
    row = torch.cat([pages, torch.tensor([-5, 10 ** 6])]).to(torch.int32)
    cache = make_kv_cache(spec, num_blocks, page_size, kv_dtype, fill=float("nan"))
    tokens = torch.randn(seq_len, spec.d_qk, generator=gen)
    for t in range(seq_len):
        blk, off = int(pages[t // page_size]), t % page_size
        if kv_dtype == "fp8":
            cache[blk, off] = quantize_kv_fp8(tokens[t, :spec.kv_lora_rank], tokens[t, spec.kv_lora_rank:], spec=spec)
        else:
            cache[blk, off, 0] = tokens[t].to(cache.dtype)
    got = gather_kv(cache, row, seq_len, spec=spec)
    if kv_dtype == "fp8":
        want = dequantize_kv_fp8(quantize_kv_fp8(tokens[:, :spec.kv_lora_rank], tokens[:, spec.kv_lora_rank:],
                                                 spec=spec), spec=spec)
    else:
        want = tokens.to(cache.dtype).float()
    assert got.dtype == torch.float32 and tuple(got.shape) == (seq_len, spec.d_qk)
    assert torch.equal(got, want)


def test_write_through_a_non_contiguous_view_updates_the_cache():
    """An engine may hand the cache as a view of a bigger allocation; writes must land in it."""
    spec = MICRO
    big = torch.zeros(4, 2, 1, spec.d_qk * 2)
    view = big[..., spec.d_qk:]
    latent, rope = torch.randn(1, spec.kv_lora_rank), torch.randn(1, spec.qk_rope_head_dim)
    write_kv_cache(view, latent, rope, torch.tensor([5], dtype=torch.int64), spec=spec)
    assert torch.equal(big[2, 1, 0, spec.d_qk:], torch.cat([latent[0], rope[0]]))
    assert int(big.count_nonzero()) == int(torch.cat([latent[0], rope[0]]).count_nonzero())


def test_fp16_cache_write_rounds_to_nearest():
    spec = MICRO
    cache = make_kv_cache(spec, 1, 1, "fp16")
    latent = torch.full((1, spec.kv_lora_rank), 1.0 + 2.0 ** -12, dtype=torch.float64)
    write_kv_cache(cache, latent, torch.zeros(1, spec.qk_rope_head_dim), torch.tensor([0]), spec=spec)
    # 1 + 2^-12 is below half an fp16 ulp at 1 (2^-11), so it rounds down to 1
    assert torch.equal(cache[0, 0, 0, :spec.kv_lora_rank], torch.ones(spec.kv_lora_rank, dtype=torch.float16))
