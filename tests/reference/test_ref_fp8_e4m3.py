"""The per-tensor FP8 cache (kv_dtype "fp8_e4m3"): codec bounds and bytes, saturation, NaN,
the reference decode against an fp64 oracle that dequantises the cache by hand, writes, layer,
indexer, and the contract's ``k_scale``."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import (Capabilities, DecodeBatch, IndexerWeights, MLALayerWeights, ModelSpec,
                              dequantize_kv_fp8_e4m3, gather_kv, indexer_topk, make_kv_cache, mla_decode,
                              mla_decode_masked, mla_layer_decode_absorbed, mla_layer_decode_naive,
                              quantize_kv_fp8_e4m3, read_slots, write_kv_cache)
from mla_fuzz.mla_ref.capabilities import ALL_KV_DTYPES
from ref_cases import (MICRO, SMALL_SPECS, assert_close_rows, assert_lse_close, build_case, dense_params,
                       oracle_dense, oracle_sparse)

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=30)
E4M3_MAX = 448.0


def fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def by_hand(cache: torch.Tensor, k_scale: float) -> torch.Tensor:
    """The values an fp8_e4m3 cache holds, dequantised without mla_ref: exact in fp64."""
    return cache.to(torch.float64) * k_scale


scales = st.builds(fp32, st.floats(2.0 ** -20, 2.0 ** 20))


# ----------------------------------------------------------------------------- the codec

@SETTINGS
@given(k_scale=scales, log_mag=st.integers(-12, 10), seed=st.integers(0, 2 ** 31 - 1))
def test_roundtrip_error_within_e4m3_bound_relative_to_the_scale(k_scale, log_mag, seed):
    """With y = x / k_scale (fp32): |deq - x| <= 2^-4 |x| + 2^-10 k_scale while |y| <= 448, and
    deq = +-448 k_scale past it.

    Why: e4m3 keeps 3 mantissa bits, so a normal y (|y| >= 2^-6) in binade [2^e, 2^(e+1)) is
    rounded by at most half its spacing 2^(e-3), i.e. <= 2^-4 |y|; below 2^-6 the spacing is the
    subnormal step 2^-9, so the error is <= 2^-10. Times k_scale (the fp64 product is exact),
    plus the fp32 division's 2^-24 relative (the 2^-20 slack covers it)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, MICRO.kv_lora_rank, generator=gen, dtype=torch.float64)
         * torch.exp(2 * torch.randn(6, MICRO.kv_lora_rank, generator=gen, dtype=torch.float64))
         * 2.0 ** log_mag * k_scale).to(torch.float32)
    rope = torch.randn(6, MICRO.qk_rope_head_dim, generator=gen).to(torch.float32) * k_scale * 100
    codes = quantize_kv_fp8_e4m3(x, rope, k_scale)
    assert codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (6, MICRO.d_qk)
    deq = dequantize_kv_fp8_e4m3(codes, k_scale, dtype=torch.float64)
    assert torch.equal(deq, by_hand(codes, k_scale))
    full = torch.cat([x, rope], dim=-1).to(torch.float64)
    y = full / k_scale
    err = (deq - full).abs()
    bound = (2.0 ** -4 + 2.0 ** -20) * full.abs() + (2.0 ** -10 + 2.0 ** -20) * k_scale
    inside = y.abs() <= E4M3_MAX * (1 - 2.0 ** -20)
    outside = y.abs() >= E4M3_MAX * (1 + 2.0 ** -20)
    assert bool((err[inside] <= bound[inside]).all()), float((err - bound)[inside].max())
    assert torch.equal(deq[outside], torch.sign(full[outside]) * E4M3_MAX * k_scale)
    edge = ~inside & ~outside  # within rounding of the top code: either
    assert bool(((err[edge] <= bound[edge]) | (deq[edge].abs() == E4M3_MAX * k_scale)).all())


def test_bytes_match_hand_encoding():
    """e4m3fn is 1 sign, 4 exponent bits (bias 7), 3 mantissa bits. At k_scale 0.5, y = 2x."""
    cases = [  # (x, byte worked out by hand)
        (1.0, 0x40),                      # y = 2 = 1.0 * 2^1: 0 1000 000
        (-224.0, 0xFE),                   # y = -448 = -1.75 * 2^8: 1 1111 110
        (224.0, 0x7E),                    # the largest finite code
        (1e9, 0x7E), (float("inf"), 0x7E), (float("-inf"), 0xFE),  # saturation: no infinity
        (3.0, 0x4C),                      # y = 6 = 1.5 * 2^2: 0 1001 100
        (-0.25, 0xB0),                    # y = -0.5 = -1.0 * 2^-1: 1 0110 000
        (2.0 ** -10, 0x01),               # y = 2^-9, the subnormal step
        (3 * 2.0 ** -11, 0x02),           # y = 1.5 * 2^-9: a tie, to even (2)
        (2.0 ** -11, 0x00),               # y = 0.5 * 2^-9: a tie, to even (0)
        (0.5 * (1 + 2.0 ** -4), 0x38),    # y = 1 + 2^-4: a tie between 1.0 and 1.125, to 1.0
        (0.5 * (1 + 3 * 2.0 ** -4), 0x3A),  # y = 1 + 3 * 2^-4: a tie, to 1.25 (mantissa 010)
        (0.0, 0x00), (-0.0, 0x80), (float("nan"), 0x7F),
    ]
    latent = torch.tensor([[x for x, _ in cases]])
    rope = torch.tensor([[2.0, -3.0]])  # y = 4 = 1.0 * 2^2: 0 1001 000; y = -6: 1 1001 100
    codes = quantize_kv_fp8_e4m3(latent, rope, 0.5).view(torch.uint8)[0].tolist()
    assert codes == [b for _, b in cases] + [0x48, 0xCC]


def test_nan_codes_stay_nan_at_any_scale():
    """e4m3fn's NaN codes (0x7F, 0xFF: the harness poisons pages with 0xFF bytes) dequantise
    to NaN whatever the scale, through every reader; a NaN fill gives NaN pages."""
    raw = torch.tensor([0x7F, 0xFF, 0x00, 0x80], dtype=torch.uint8).view(torch.float8_e4m3fn)
    for s in (2.0 ** -20, 1.0, 3.5, 2.0 ** 20):
        got = dequantize_kv_fp8_e4m3(raw, s)
        assert bool(got[:2].isnan().all()) and got[2:].tolist() == [0.0, -0.0]
    spec = MICRO
    cache = make_kv_cache(spec, 2, 4, "fp8_e4m3", fill=float("nan"))
    assert cache.dtype == torch.float8_e4m3fn and tuple(cache.shape) == (2, 4, 1, spec.d_qk)
    assert bool(gather_kv(cache, torch.tensor([1, 0]), 7, spec=spec, k_scale=0.25).isnan().all())
    poisoned = torch.full((2, 4, 1, spec.d_qk), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert bool(read_slots(poisoned, torch.tensor([0, 5]), spec=spec, k_scale=2.0).isnan().all())
    assert bool(quantize_kv_fp8_e4m3(torch.full((1, 32), float("nan")), torch.zeros(1, 8), 1.0)[0, :32]
                .float().isnan().all())


def test_make_kv_cache_fill_reads_back_at_scale_one_saturated():
    spec = MICRO
    assert torch.equal(make_kv_cache(spec, 2, 3, "fp8_e4m3").view(torch.uint8), torch.zeros(2, 3, 1, 40,
                                                                                            dtype=torch.uint8))
    for fill, back in ((1.5, 1.5), (-3.0, -3.0), (1000.0, 448.0), (float("-inf"), -448.0), (0.3, 0.3125)):
        cache = make_kv_cache(spec, 2, 3, "fp8_e4m3", fill=fill)
        assert bool((cache.to(torch.float64) == back).all()), (fill, cache.flatten()[0])


# ----------------------------------------------------------------------------- decode

# (q dtype) -> (row rtol on out, atol on lse), as tests/reference/test_ref_decode.py: fp64
# compute is exact up to summation order, fp32 compute ~1e-6
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-6, 2e-5)}


@SETTINGS
@given(p=dense_params(), q_dtype=st.sampled_from([torch.float64, torch.float32]), causal=st.booleans(),
       k_scale=st.sampled_from([2.0 ** -5, 0.0123, 3.0]), given_q_lens=st.booleans(), poison=st.booleans())
def test_decode_matches_fp64_softmax_over_the_hand_dequantised_cache(p, q_dtype, causal, k_scale, given_q_lens,
                                                                     poison):
    """Dense decode, MTP bottom-right causal (ragged q_lens) and non-causal, against an fp64
    softmax over ``cache.to(fp64) * k_scale`` (the keys ``build_case`` wrote with torch ops),
    with NaN codes in every slot no request owns when ``poison``; k_scale as a float or tensor."""
    if not given_q_lens:
        p["q_lens"] = None
    case = build_case(**p, kv_dtype="fp8_e4m3", q_dtype=q_dtype, k_scale=k_scale, poison=poison, extra_cols=1)
    scale_arg = case.k_scale if p["seed"] % 2 else torch.tensor([case.k_scale], dtype=torch.float32)
    out, lse = mla_decode(*case.args(), spec=case.spec, causal=causal, q_lens=case.q_lens, k_scale=scale_arg)
    ref_out, ref_lse = oracle_dense(case, causal=causal)
    rtol, atol = TOL[q_dtype]
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert_close_rows(out, ref_out, rtol=rtol)
    assert_lse_close(lse, ref_lse, atol=atol)
    # the keys the oracle used are the cache's own bytes times the scale, not the quantiser's
    for b, keys in enumerate(case.keys):
        L = keys.shape[0]
        rows = torch.stack([case.kv_cache[case.block_table[b, t // case.page_size], t % case.page_size, 0]
                            for t in range(L)]) if L else case.kv_cache.new_empty(0, case.spec.d_qk)
        assert torch.equal(by_hand(rows, case.k_scale), keys)


@SETTINGS
@given(p=dense_params(max_len=30), topk=st.integers(1, 12), data=st.data())
def test_sparse_decode_matches_fp64_softmax_over_the_selected_slots(p, topk, data):
    """Sparse top-k: random slots of any request (repeats, -1 holes, topk_length cuts), against
    an fp64 softmax over ``cache.to(fp64) * k_scale`` at the chosen slots; only slots real tokens
    wrote are picked (the rest hold NaN codes)."""
    case = build_case(**p, kv_dtype="fp8_e4m3", q_dtype=torch.float64, k_scale=0.07, poison=True, spare_blocks=2)
    B, s_q = case.q.shape[:2]
    owned = [case.slot(b, t) for b, L in enumerate(p["seq_lens"]) for t in range(L)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    pool = torch.tensor(owned + [-1], dtype=torch.int32)
    indices = pool[torch.randint(0, len(pool), (B, s_q, topk), generator=gen)]
    topk_length = torch.tensor([data.draw(st.integers(0, topk)) for _ in range(B)], dtype=torch.int32)
    n_slots = case.kv_cache.shape[0] * case.kv_cache.shape[1]
    slot_values = by_hand(case.kv_cache.reshape(n_slots, case.spec.d_qk), case.k_scale)
    q_lens = p["q_lens"]
    ref_out, ref_lse = oracle_sparse(case.q, slot_values, indices, topk_length.tolist(), q_lens, case.spec)
    out, lse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens, indices=indices, topk_length=topk_length,
                          k_scale=case.k_scale)
    assert_close_rows(out, ref_out, rtol=1e-12)
    assert_lse_close(lse, ref_lse, atol=1e-9)


@SETTINGS
@given(p=dense_params(), seed=st.integers(0, 2 ** 31 - 1))
def test_masked_decode_matches_mla_decode(p, seed):
    """The capturable reference (tensor k_scale, no host read) computes what mla_decode does."""
    case = build_case(**p, kv_dtype="fp8_e4m3", q_dtype=torch.float32, k_scale=0.03, poison=True)
    ks = torch.tensor([case.k_scale], dtype=torch.float32)
    want = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens, k_scale=ks)
    # every block-table entry must be a page: unused columns point at page 0 (NaN codes there)
    bt = case.block_table.clone()
    for b, L in enumerate(p["seq_lens"]):
        bt[b, -(-L // case.page_size):] = 0
    got = mla_decode_masked(case.q, case.kv_cache, bt, case.cache_seqlens, spec=case.spec, q_lens=case.q_lens,
                            k_scale=ks)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------- writes

@pytest.mark.parametrize("k_scale", [0.5, 2.0 ** -7, 13.25])
def test_write_kv_cache_saturates_and_skips(k_scale):
    """Rows are stored as the hand encoding ``rne(clamp(x / k_scale, +-448))``: values past
    448 k_scale (and +-inf) read back as exactly +-448 k_scale, NaN as NaN; slot -1 and every
    other slot keep their bytes; a float and a tensor scale write the same bytes."""
    spec = MICRO
    g = torch.Generator().manual_seed(4)
    T = 5
    latent = torch.randn(T, spec.kv_lora_rank, generator=g) * 100 * k_scale
    latent[0, :4] = torch.tensor([1e6 * k_scale, -1e6 * k_scale, float("inf"), float("-inf")])
    latent[1, :2] = torch.tensor([448 * k_scale, -500 * k_scale])
    latent[2, 5] = float("nan")
    rope = torch.randn(T, spec.qk_rope_head_dim, generator=g) * 1000 * k_scale
    slots = torch.tensor([3, 9, -1, 0, 14], dtype=torch.int64)
    cache = make_kv_cache(spec, 4, 4, "fp8_e4m3", fill=float("nan"))
    before = cache.clone()
    write_kv_cache(cache, latent, rope, slots, spec=spec, k_scale=k_scale)
    flat = cache.view(torch.uint8).reshape(16, spec.d_qk)
    want = torch.cat([latent, rope], dim=-1)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        hand = ((want[t] / torch.tensor(k_scale)).clamp(-448, 448).to(torch.float8_e4m3fn)).view(torch.uint8)
        nan = want[t].isnan()
        assert torch.equal(flat[s][~nan], hand[~nan])
        assert bool(flat[s][nan].view(torch.float8_e4m3fn).float().isnan().all())
    back = read_slots(cache, torch.tensor([3, 9]), spec=spec, k_scale=k_scale, dtype=torch.float64)
    assert back[0, :4].tolist() == [448 * k_scale, -448 * k_scale, 448 * k_scale, -448 * k_scale]
    assert back[1, :2].tolist() == [448 * k_scale, -448 * k_scale]
    sat = (want[:2].abs() >= 448 * k_scale)
    assert bool((back[sat].abs() == 448 * k_scale).all())
    untouched = [s for s in range(16) if s not in (3, 9, 0, 14)]
    assert torch.equal(flat[untouched], before.view(torch.uint8).reshape(16, -1)[untouched])
    again = make_kv_cache(spec, 4, 4, "fp8_e4m3", fill=float("nan"))
    write_kv_cache(again, latent, rope, slots, spec=spec, k_scale=torch.tensor([k_scale]))
    assert torch.equal(again.view(torch.uint8), cache.view(torch.uint8))


# ----------------------------------------------------------------------------- layer, indexer

@pytest.mark.parametrize("spec", SMALL_SPECS[:2], ids=["micro", "tiny3"])
def test_layer_naive_equals_absorbed_and_writes_the_same_cache(spec):
    """Both layer forms write the step's tokens with the scale and read them back with it."""
    g = torch.Generator().manual_seed(5)
    w = MLALayerWeights.random(spec, seed=3, dtype=torch.float32)
    seq, ql, ps = [9, 1, 17], [2, 1, 2], 4
    pages = [-(-L // ps) for L in seq]
    bt = torch.zeros(3, max(pages), dtype=torch.int32)
    nxt = 1
    for b, n in enumerate(pages):
        bt[b, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
        nxt += n
    cache = make_kv_cache(spec, nxt, ps, "fp8_e4m3")
    hist = [int(bt[b, t // ps]) * ps + t % ps for b in range(3) for t in range(seq[b] - ql[b])]
    k_scale = 0.01
    write_kv_cache(cache, torch.randn(len(hist), spec.kv_lora_rank, generator=g),
                   torch.randn(len(hist), spec.qk_rope_head_dim, generator=g), torch.tensor(hist), spec=spec,
                   k_scale=k_scale)
    slot_mapping = torch.full((3, 2), -1, dtype=torch.int64)
    positions = torch.zeros(3, 2, dtype=torch.int64)
    for b in range(3):
        for i in range(ql[b]):
            t = seq[b] - ql[b] + i
            slot_mapping[b, i], positions[b, i] = int(bt[b, t // ps]) * ps + t % ps, t
    hidden = torch.randn(3, 2, spec.hidden, generator=g)
    args = dict(positions=positions, block_table=bt, cache_seqlens=torch.tensor(seq, dtype=torch.int32),
                slot_mapping=slot_mapping, spec=spec, q_lens=torch.tensor(ql, dtype=torch.int32), k_scale=k_scale)
    c1, c2 = cache.clone(), cache.clone()
    a = mla_layer_decode_absorbed(w, hidden, kv_cache=c1, **args)
    n = mla_layer_decode_naive(w, hidden, kv_cache=c2, **args)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    assert not torch.equal(c1.view(torch.uint8), cache.view(torch.uint8))
    torch.testing.assert_close(a, n, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="k_scale"):
        mla_layer_decode_absorbed(w, hidden, kv_cache=cache.clone(), **dict(args, k_scale=None))


def test_indexer_on_fp8_e4m3_equals_indexer_on_its_fp64_dequantisation():
    spec = ModelSpec.tiny(num_heads=4)
    case = build_case(spec, seq_lens=[13, 0, 30], s_q=2, page_size=4, q_lens=[2, 0, 1], kv_dtype="fp8_e4m3",
                      q_dtype=torch.float32, k_scale=0.02, seed=8)
    w = IndexerWeights.random(spec, seed=1)
    deq = by_hand(case.kv_cache, case.k_scale)
    want = indexer_topk(w, case.q, deq, case.block_table, case.cache_seqlens, case.q_lens, 6, spec=spec)
    got = indexer_topk(w, case.q, case.kv_cache, case.block_table, case.cache_seqlens, case.q_lens, 6, spec=spec,
                       k_scale=case.k_scale)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- validation

def _small_e4m3():
    return build_case(MICRO, seq_lens=[5, 2], s_q=1, page_size=4, kv_dtype="fp8_e4m3", q_dtype=torch.float32)


@pytest.mark.parametrize("bad", [None, 0.0, -1.0, float("inf"), float("nan"), 1e-50, 1e39, True, "0.5",
                                 torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.5, 1.0]),
                                 torch.tensor([0.0]), torch.tensor([-2.0])])
def test_bad_or_missing_k_scale_is_a_one_line_value_error(bad):
    case = _small_e4m3()
    lat, rope = torch.zeros(1, 32), torch.zeros(1, 8)
    calls = [lambda: mla_decode(*case.args(), spec=MICRO, k_scale=bad),
             lambda: write_kv_cache(case.kv_cache, lat, rope, torch.tensor([7]), spec=MICRO, k_scale=bad),
             lambda: gather_kv(case.kv_cache, case.block_table[0], 5, spec=MICRO, k_scale=bad),
             lambda: read_slots(case.kv_cache, torch.tensor([0]), spec=MICRO, k_scale=bad)]
    if bad is not None:
        calls += [lambda: quantize_kv_fp8_e4m3(lat, rope, bad), lambda: dequantize_kv_fp8_e4m3(case.kv_cache, bad)]
    for call in calls:
        with pytest.raises(ValueError, match="k_scale") as e:
            call()
        assert "\n" not in str(e.value)


def test_k_scale_is_refused_for_other_caches():
    for kv in ("fp32", "fp8"):
        case = build_case(MICRO, seq_lens=[5], s_q=1, page_size=4, kv_dtype=kv, q_dtype=torch.float32)
        with pytest.raises(ValueError, match="k_scale is only for an fp8_e4m3"):
            mla_decode(*case.args(), spec=MICRO, k_scale=1.0)
        with pytest.raises(ValueError, match="k_scale is only for an fp8_e4m3"):
            gather_kv(case.kv_cache, case.block_table[0], 5, spec=MICRO, k_scale=1.0)
        with pytest.raises(ValueError, match="k_scale is only for an fp8_e4m3"):
            mla_decode_masked(*case.args(), spec=MICRO, k_scale=torch.ones(1))


def test_cache_helpers_and_kv_dtype_names():
    case = _small_e4m3()
    assert mla_ref.is_fp8_e4m3_cache(case.kv_cache) and not mla_ref.is_fp8_cache(case.kv_cache)
    fp8 = make_kv_cache(MICRO, 1, 2, "fp8")
    assert mla_ref.is_fp8_cache(fp8) and not mla_ref.is_fp8_e4m3_cache(fp8)
    mla_ref.check_kv_cache(case.kv_cache, spec=MICRO)
    with pytest.raises(ValueError, match="d_qk"):
        mla_ref.check_kv_cache(case.kv_cache[..., :10], spec=MICRO)
    assert "fp8_e4m3" in mla_ref.KV_DTYPES and "fp8_e4m3" in ALL_KV_DTYPES
    # opt-in: a backend declaring nothing is not drawn the format it would have to read k_scale for
    assert "fp8_e4m3" not in Capabilities().kv_dtypes
    assert Capabilities(kv_dtypes=("fp8_e4m3",)).kv_dtypes == ("fp8_e4m3",)


# ----------------------------------------------------------------------------- DecodeBatch

def _batch(**kw):
    base = dict(seq_lens=torch.tensor([5, 3], dtype=torch.int32), q_lens=torch.tensor([1, 1], dtype=torch.int32),
                block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                slot_mapping=torch.tensor([[8], [14]], dtype=torch.int64), page_size=4)
    base.update(kw)
    return DecodeBatch(**base)


def test_decode_batch_k_scale_validation():
    ok = _batch(kv_dtype="fp8_e4m3", k_scale=torch.tensor([0.125]))
    assert ok.k_scale.shape == (1,)
    assert fields(DecodeBatch)[-1].name == "k_scale"  # last: positional construction unchanged
    for kw, msg in ((dict(kv_dtype="fp8_e4m3"), "k_scale is required"),
                    (dict(kv_dtype="fp8_e4m3", k_scale=0.125), "k_scale is required"),
                    (dict(kv_dtype="fp8_e4m3", k_scale=torch.tensor([0.125], dtype=torch.float64)), "fp32"),
                    (dict(kv_dtype="fp8_e4m3", k_scale=torch.tensor([0.125, 1.0])), r"shape \[1\]"),
                    (dict(kv_dtype="fp8_e4m3", k_scale=torch.tensor(0.125)), r"shape \[1\]"),
                    (dict(kv_dtype="bf16", k_scale=torch.tensor([0.125])), "only for kv_dtype 'fp8_e4m3'"),
                    (dict(kv_dtype="fp8", k_scale=torch.tensor([0.125])), "only for kv_dtype 'fp8_e4m3'")):
        with pytest.raises(ValueError, match=msg):
            _batch(**kw)


def test_decode_batch_k_scale_round_trips_through_json():
    value = fp32(0.0123)
    b = _batch(kv_dtype="fp8_e4m3", k_scale=torch.tensor([value]))
    d = json.loads(json.dumps(b.to_dict()))
    assert d["k_scale"] == value and d["kv_dtype"] == "fp8_e4m3"
    back = DecodeBatch.from_dict(d)
    assert back.k_scale.dtype == torch.float32 and back.k_scale.device.type == "cpu"
    assert tuple(back.k_scale.shape) == (1,) and torch.equal(back.k_scale, b.k_scale)
    assert back.to_dict() == b.to_dict()
    plain = _batch().to_dict()
    assert "k_scale" not in plain and DecodeBatch.from_dict(plain).k_scale is None
