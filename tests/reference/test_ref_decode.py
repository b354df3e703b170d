"""mla_decode: against an independent fp64 softmax, MTP, invariances, FP8, sparse, conventions."""
import time

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_fuzz.mla_ref import ModelSpec, dequantize_kv_fp8, mla_decode
from ref_cases import (MICRO, assert_close_rows, assert_lse_close, build_case, dense_params,
                       oracle_dense, oracle_sparse)

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=30)
NEG_INF = float("-inf")

# (q dtype, cache dtype) -> (row rtol on out, atol on lse). fp64 is exact up to summation
# order; fp32 compute gives ~1e-6; a 16-bit q/out adds one rounding of q (the oracle sees the
# same rounded q) and one of out (2^-8 bf16, 2^-11 fp16 relative to the row's magnitude).
TOL = {
    (torch.float64, "fp64"): (1e-12, 1e-12),
    (torch.float64, "fp32"): (1e-12, 1e-12),
    (torch.float32, "fp32"): (2e-6, 2e-5),
    (torch.float32, "fp8"): (2e-6, 2e-5),
    (torch.bfloat16, "bf16"): (2.0 ** -8, 2e-5),
    (torch.float16, "fp16"): (2.0 ** -10, 2e-5),
}


def _padding_is_zero(out, lse, q_lens, s_q):
    for b, ql in enumerate(q_lens):
        assert torch.equal(out[b, ql:], torch.zeros_like(out[b, ql:]))
        assert bool(torch.isneginf(lse[b, :, ql:]).all())


@SETTINGS
@given(p=dense_params(), dtypes=st.sampled_from(sorted(TOL, key=str)), causal=st.booleans(),
       given_q_lens=st.booleans())
def test_matches_direct_softmax(p, dtypes, causal, given_q_lens):
    q_dtype, kv_dtype = dtypes
    if not given_q_lens:
        p["q_lens"] = None
    case = build_case(**p, kv_dtype=kv_dtype, q_dtype=q_dtype)
    out, lse = mla_decode(*case.args(), spec=case.spec, causal=causal, q_lens=case.q_lens)
    B, s_q, h, _ = case.q.shape
    assert out.dtype == q_dtype and tuple(out.shape) == (B, s_q, h, case.spec.kv_lora_rank)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (B, h, s_q)
    ref_out, ref_lse = oracle_dense(case, causal=causal)
    rtol, atol = TOL[dtypes]
    assert_close_rows(out, ref_out, rtol=rtol)
    assert_lse_close(lse, ref_lse, atol=atol)
    if case.q_lens is not None:
        _padding_is_zero(out, lse, p["q_lens"], s_q)


def test_softmax_scale_override_and_default():
    case = build_case(MICRO, seq_lens=[9, 4], s_q=2, page_size=4, q_lens=[2, 1], seed=3)
    for scale in (None, 0.05, 1.0):
        out, lse = mla_decode(*case.args(), spec=MICRO, softmax_scale=scale, q_lens=case.q_lens)
        ref_out, ref_lse = oracle_dense(case, softmax_scale=scale)
        assert_close_rows(out, ref_out, rtol=1e-12)
        assert_lse_close(lse, ref_lse, atol=1e-12)
    # the default is the model's 1/sqrt(nope + rope), not 1/sqrt(d_qk)
    default, _ = mla_decode(*case.args(), spec=MICRO, q_lens=case.q_lens)
    explicit, _ = mla_decode(*case.args(), spec=MICRO, q_lens=case.q_lens, softmax_scale=(16 + 8) ** -0.5)
    assert torch.equal(default, explicit)


def test_lse_is_natural_log_of_the_partition_function():
    """A hand-sized case: one head, keys e1 and 0, q = 2 e1 with scale 1 -> scores (2, 0)."""
    spec = ModelSpec(kv_lora_rank=2, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2, num_heads=1,
                     q_lora_rank=2, hidden=2, fp8_group=2)
    cache = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    cache[0, 0, 0, 0] = 1.0
    q = torch.tensor([2.0, 0, 0, 0], dtype=torch.float64).view(1, 1, 1, 4)
    out, lse = mla_decode(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                          spec=spec, softmax_scale=1.0)
    z = torch.exp(torch.tensor(2.0, dtype=torch.float64)) + 1
    assert abs(float(lse[0, 0, 0]) - float(torch.log(z))) < 1e-6
    assert torch.allclose(out[0, 0, 0], torch.tensor([float(torch.exp(torch.tensor(2.0, dtype=torch.float64)) / z),
                                                      0.0], dtype=torch.float64), rtol=0, atol=1e-15)


@SETTINGS
@given(p=dense_params(max_s_q=4))
def test_mtp_equals_one_token_at_a_time(p):
    """Token i of an MTP step equals a single-token decode that sees seq_len - q_len + i + 1 keys."""
    case = build_case(**p, kv_dtype="fp32", q_dtype=torch.float32)
    out, lse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens)
    for b, (L, ql) in enumerate(zip(p["seq_lens"], p["q_lens"])):
        for i in range(ql):
            one_out, one_lse = mla_decode(case.q[b:b + 1, i:i + 1], case.kv_cache, case.block_table[b:b + 1],
                                          torch.tensor([L - ql + i + 1], dtype=torch.int32), spec=case.spec)
            torch.testing.assert_close(out[b, i], one_out[0, 0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(lse[b, :, i], one_lse[0, :, 0], rtol=1e-6, atol=1e-6)


@SETTINGS
@given(p=dense_params(), kv_dtype=st.sampled_from(["bf16", "fp8"]), seed=st.integers(0, 2 ** 31 - 1))
def test_physical_page_permutation_changes_nothing(p, kv_dtype, seed):
    case = build_case(**p, kv_dtype=kv_dtype, q_dtype=torch.float32)
    base = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens)
    nb = case.kv_cache.shape[0]
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))
    moved = torch.empty_like(case.kv_cache)
    moved[perm] = case.kv_cache  # physical page p now lives at perm[p]
    table = perm[case.block_table.long()].to(torch.int32)
    got = mla_decode(case.q, moved, table, case.cache_seqlens, spec=case.spec, q_lens=case.q_lens)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


@SETTINGS
@given(p=dense_params(), seed=st.integers(0, 2 ** 31 - 1))
def test_batch_permutation_permutes_outputs(p, seed):
    case = build_case(**p, kv_dtype="bf16", q_dtype=torch.bfloat16)
    out, lse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens)
    perm = torch.randperm(case.q.shape[0], generator=torch.Generator().manual_seed(seed))
    out_p, lse_p = mla_decode(case.q[perm], case.kv_cache, case.block_table[perm], case.cache_seqlens[perm],
                              spec=case.spec, q_lens=case.q_lens[perm])
    assert torch.equal(out_p, out[perm]) and torch.equal(lse_p, lse[perm])


@SETTINGS
@given(p=dense_params(), n_pad=st.integers(1, 3), junk_q=st.sampled_from([0.0, 1e4, float("nan")]))
def test_appending_padded_rows_changes_no_real_row(p, n_pad, junk_q):
    case = build_case(**p, kv_dtype="fp32", q_dtype=torch.float32)
    out, lse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens)
    B, s_q, h, d = case.q.shape
    q = torch.cat([case.q, torch.full((n_pad, s_q, h, d), junk_q)])
    # padded rows as engines build them: seq_len 0, q_len 0, block table pointing anywhere
    table = torch.cat([case.block_table, torch.full((n_pad, case.block_table.shape[1]), 10 ** 6, dtype=torch.int32)])
    seqlens = torch.cat([case.cache_seqlens, torch.zeros(n_pad, dtype=torch.int32)])
    q_lens = torch.cat([case.q_lens, torch.zeros(n_pad, dtype=torch.int32)])
    out_p, lse_p = mla_decode(q, case.kv_cache, table, seqlens, spec=case.spec, q_lens=q_lens)
    assert torch.equal(out_p[:B], out) and torch.equal(lse_p[:B], lse)
    assert torch.equal(out_p[B:], torch.zeros_like(out_p[B:]))
    assert bool(torch.isneginf(lse_p[B:]).all())


@SETTINGS
@given(p=dense_params(), kv_dtype=st.sampled_from(["bf16", "fp16", "fp8"]))
def test_nan_outside_the_sequence_and_garbage_table_columns_change_nothing(p, kv_dtype):
    """Poison every slot past each seq_len, every unused page, unused block-table columns and
    the query tokens that are padding: real rows must be unchanged and finite."""
    dirty = build_case(**p, kv_dtype=kv_dtype, q_dtype=torch.float32, poison=True, extra_cols=2, spare_blocks=2)
    q = dirty.q.clone()
    for b, ql in enumerate(p["q_lens"]):
        q[b, ql:] = float("nan")
    out, lse = mla_decode(q, dirty.kv_cache, dirty.block_table, dirty.cache_seqlens, spec=dirty.spec,
                          q_lens=dirty.q_lens)
    ref_out, ref_lse = oracle_dense(dirty)
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert_close_rows(out, ref_out, rtol=2e-6)
    assert_lse_close(lse, ref_lse, atol=2e-5)
    _padding_is_zero(out, lse, p["q_lens"], q.shape[1])


@SETTINGS
@given(p=dense_params(), causal=st.booleans())
def test_fp8_cache_equals_its_dequantized_cache(p, causal):
    case = build_case(**p, kv_dtype="fp8", q_dtype=torch.float32)
    deq = dequantize_kv_fp8(case.kv_cache, spec=case.spec).unsqueeze(2)  # [nb, ps, 1, d_qk] fp32
    got = mla_decode(*case.args(), spec=case.spec, causal=causal, q_lens=case.q_lens)
    want = mla_decode(case.q, deq, case.block_table, case.cache_seqlens, spec=case.spec, causal=causal,
                      q_lens=case.q_lens)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_zero_length_rows_and_padding_tokens_are_exact_zero_and_neg_inf():
    case = build_case(ModelSpec.tiny(), seq_lens=[0, 5, 0, 7], s_q=3, page_size=4, q_lens=[0, 2, 0, 3],
                      q_dtype=torch.bfloat16, kv_dtype="bf16", poison=True)
    out, lse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens)
    for b, ql in enumerate([0, 2, 0, 3]):
        assert torch.equal(out[b, ql:], torch.zeros_like(out[b, ql:]))  # exact zeros, not tiny values
        assert bool(torch.isneginf(lse[b, :, ql:]).all())
        assert bool(torch.isfinite(lse[b, :, :ql]).all()) and bool(out[b, :ql].isfinite().all())
    # q_lens omitted: every token is real; a zero-length row still has nothing to see
    out, lse = mla_decode(case.q[:1], case.kv_cache, case.block_table[:1], case.cache_seqlens[:1], spec=case.spec)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    out, lse = mla_decode(case.q[:1], case.kv_cache, case.block_table[:1], case.cache_seqlens[:1], spec=case.spec,
                          causal=False)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


# ----------------------------------------------------------------------------- sparse

@SETTINGS
@given(p=dense_params(max_s_q=1, max_len=30), n_invalid=st.integers(0, 5), seed=st.integers(0, 2 ** 31 - 1))
def test_sparse_over_the_whole_sequence_equals_dense_non_causal(p, n_invalid, seed):
    p["q_lens"] = [min(1, L) for L in p["seq_lens"]]
    case = build_case(**p, kv_dtype="bf16", q_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    B = len(p["seq_lens"])
    topk = max(p["seq_lens"] + [0]) + n_invalid
    indices = torch.full((B, 1, max(topk, 1)), -1, dtype=torch.int32)
    for b, L in enumerate(p["seq_lens"]):
        slots = torch.tensor([case.slot(b, t) for t in range(L)] + [-1] * (topk - L), dtype=torch.int32)
        indices[b, 0, :topk] = slots[torch.randperm(topk, generator=gen)]  # any order, -1s anywhere
    sparse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens, indices=indices)
    dense = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens, causal=False)
    torch.testing.assert_close(sparse[0], dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse[1], dense[1], rtol=1e-5, atol=1e-5)
    for b, L in enumerate(p["seq_lens"]):
        if L == 0:
            assert torch.equal(sparse[0][b], torch.zeros_like(sparse[0][b]))
            assert bool(torch.isneginf(sparse[1][b]).all())


@SETTINGS
@given(p=dense_params(max_len=30), topk=st.integers(1, 12), data=st.data())
def test_sparse_matches_direct_softmax_and_honours_topk_length(p, topk, data):
    """Random slot subsets (repeats allowed), -1 holes, topk_length cuts, garbage past the cut
    (including out-of-range values) and in padding tokens' rows."""
    case = build_case(**p, kv_dtype="fp32", q_dtype=torch.float64, spare_blocks=2)
    B, s_q = case.q.shape[:2]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    n_slots = case.kv_cache.shape[0] * case.kv_cache.shape[1]
    # any slot may be picked, including ones no request owns and other requests' tokens:
    # in sparse mode the indices alone define the key set
    indices = torch.randint(-1, n_slots, (B, s_q, topk), generator=gen, dtype=torch.int32)
    topk_length = torch.tensor([data.draw(st.integers(0, topk)) for _ in range(B)], dtype=torch.int32)
    garbage = indices.clone()
    for b in range(B):
        garbage[b, :, int(topk_length[b]):] = -7 if b % 2 else 10 ** 6
        garbage[b, p["q_lens"][b]:] = -123
    slot_values = case.kv_cache.reshape(n_slots, case.spec.d_qk).double()
    ref_out, ref_lse = oracle_sparse(case.q, slot_values, indices, topk_length.tolist(), p["q_lens"], case.spec)
    for idx in (indices, garbage):
        out, lse = mla_decode(*case.args(), spec=case.spec, q_lens=case.q_lens, indices=idx,
                              topk_length=topk_length)
        assert_close_rows(out, ref_out, rtol=1e-12)
        assert_lse_close(lse, ref_lse, atol=1e-9)
        _padding_is_zero(out, lse, p["q_lens"], s_q)


def test_sparse_row_without_valid_index_is_zero_and_neg_inf():
    case = build_case(MICRO, seq_lens=[6, 6], s_q=2, page_size=4, q_lens=[2, 2], kv_dtype="bf16",
                      q_dtype=torch.bfloat16)
    indices = torch.full((2, 2, 4), -1, dtype=torch.int32)
    indices[0, 1, 2] = case.slot(0, 3)
    indices[1, :, 0] = case.slot(1, 0)
    out, lse = mla_decode(*case.args(), spec=MICRO, q_lens=case.q_lens, indices=indices,
                          topk_length=torch.tensor([4, 0], dtype=torch.int32))
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and bool(torch.isneginf(lse[0, :, 0]).all())
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isneginf(lse[1]).all())  # topk_length 0
    # a single key: softmax weight 1, so out is that key's value part (rounded to bf16)
    key = case.keys[0][3, :MICRO.kv_lora_rank].to(torch.bfloat16)
    assert torch.equal(out[0, 1], key.expand_as(out[0, 1]))


# ----------------------------------------------------------------------------- DeepSeek size

def test_deepseek_size_bf16_and_fp8_against_direct_softmax():
    """h=128, d_qk=576, a few thousand keys, ragged MTP batch: correct and fast on CPU."""
    spec = ModelSpec.deepseek_v3()
    p = dict(seq_lens=[3000, 1, 700, 0, 2049], q_lens=[2, 1, 1, 0, 2], s_q=2, page_size=64, seed=11)
    start = time.perf_counter()
    for kv_dtype in ("bf16", "fp8"):
        case = build_case(spec, **p, kv_dtype=kv_dtype, q_dtype=torch.bfloat16, poison=True, extra_cols=1)
        out, lse = mla_decode(*case.args(), spec=spec, q_lens=case.q_lens)
        ref_out, ref_lse = oracle_dense(case)
        assert_close_rows(out, ref_out, rtol=2.0 ** -8)
        assert_lse_close(lse, ref_lse, atol=1e-4)
    assert time.perf_counter() - start < 60
