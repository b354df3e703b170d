"""Sparse top-k decode (kernels.mla_decode with indices=, the ragged backend path) and the
top-k indexer, each against its mla_ref reference (CPU interpreter; DeepSeek size on GPU)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import DecodeBatch, IndexerWeights, ModelSpec

from mla_fuzz import kernels
from mla_fuzz.kernels import DecodeConfig, TritonMLABackend, host_context_lens
from mla_fuzz.kernels.indexer import indexer_topk
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, lens_strategy, make_case

_CPU_CONFIGS = [DecodeConfig(block_m=16, block_n=16, num_parts=p, min_tiles_per_part=1, num_stages=1)
                for p in (1, 3, 7)]


def random_selection(case, s_q: int, topk: int, gen: torch.Generator, *, dup: bool = False) -> torch.Tensor:
    """int32 ``[B, s_q, topk]``: per real token, distinct visible slots (bottom-right causal)
    in random order, then -1s in random places; padding tokens all -1. ``dup`` repeats a slot."""
    B = case.batch
    idx = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    for b in range(B):
        L, ql = int(case.seq_lens[b]), int(case.q_lens[b])
        for i in range(ql):
            visible = L - ql + i + 1
            k = int(torch.randint(0, min(topk, visible) + 1, (1,), generator=gen))
            row = [case.slot(b, p) for p in torch.randperm(visible, generator=gen)[:k].tolist()]
            if dup and row and len(row) < topk:
                row.append(row[0])
            row += [-1] * (topk - len(row))
            perm = torch.randperm(topk, generator=gen).tolist()
            idx[b, i] = torch.tensor([row[j] for j in perm], dtype=torch.int32)
    return idx


@st.composite
def sparse_case(draw):
    heads = draw(st.sampled_from([1, 3, 8, 17]))
    s_q = draw(st.integers(1, 3))
    page = draw(st.sampled_from([1, 4, 16]))
    seq, ql = draw(lens_strategy(max_batch=3, max_len=70, s_q=s_q, page_size=page))
    kv = draw(st.sampled_from(["bf16", "fp16", "fp8", "fp8_e4m3"]))
    topk = draw(st.sampled_from([1, 7, 16, 40]))
    with_len = draw(st.booleans())
    cfg = draw(st.sampled_from(_CPU_CONFIGS))
    return heads, s_q, page, seq, ql, kv, topk, with_len, cfg, draw(st.integers(0, 2 ** 16)), draw(st.booleans())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_case())
def test_sparse_decode_matches_reference_interpreter(args):
    heads, s_q, page, seq, ql, kv, topk, with_len, cfg, seed, dup = args
    spec = ModelSpec.tiny(num_heads=heads)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    idx = random_selection(case, s_q, topk, gen, dup=dup)
    tl = torch.randint(0, topk + 1, (case.batch,), generator=gen, dtype=torch.int32) if with_len else None
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, indices=idx, topk_length=tl, config=cfg, k_scale=case.k_scale)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                             indices=idx, topk_length=tl, k_scale=case.k_scale)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[case.q.dtype],
                        what=f"h={heads} s_q={s_q} seq={seq} ql={ql} {kv} topk={topk} len={tl} dup={dup}")


def test_sparse_decode_rejects_bad_arguments():
    spec = ModelSpec.tiny(num_heads=2)
    case = make_case(spec, seq_lens=[5, 3], q_lens=[1, 1], s_q=2, page_size=4, kv_dtype="bf16")
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens)
    good = torch.zeros(2, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must have dtype int32"):
        kernels.mla_decode(*args, spec=spec, indices=good.long())
    with pytest.raises(ValueError, match="indices must have shape"):
        kernels.mla_decode(*args, spec=spec, indices=good[:1])
    with pytest.raises(ValueError, match="indices must be contiguous"):
        kernels.mla_decode(*args, spec=spec, indices=good.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="topk_length"):
        kernels.mla_decode(*args, spec=spec, indices=good, topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="only meaningful with indices"):
        kernels.mla_decode(*args, spec=spec, topk_length=torch.zeros(2, dtype=torch.int32))


# --------------------------------------------------------------------------- ragged backend path

def ragged_batch(case, *, next_n, topk, pad_to, gen, kv_dtype="bf16"):
    """A DecodeBatch carrying a random ragged selection (rows of -1 padding included)."""
    B = case.batch
    flat, indptr = [], [0]
    for b in range(B):
        L, ql = int(case.seq_lens[b]), int(case.q_lens[b])
        for i in range(next_n):
            if i < ql:
                visible = L - ql + i + 1
                k = int(torch.randint(0, min(topk, visible) + 1, (1,), generator=gen))
                flat += [case.slot(b, p) for p in torch.randperm(visible, generator=gen)[:k].tolist()]
                flat += [-1] * int(torch.randint(0, topk - k + 1, (1,), generator=gen))
            indptr.append(len(flat))
    slots = torch.full((B, next_n), -1, dtype=torch.int64)
    return DecodeBatch(seq_lens=case.seq_lens, q_lens=case.q_lens, block_table=case.block_table, slot_mapping=slots,
                       page_size=case.page_size, next_n=next_n, pad_to=pad_to, kv_dtype=kv_dtype,
                       topk_flat=torch.tensor(flat, dtype=torch.int32),
                       topk_indptr=torch.tensor(indptr, dtype=torch.int32), topk=topk,
                       k_scale=case.k_scale if kv_dtype == "fp8_e4m3" else None)


def padded(q, pad):
    out = torch.full((pad,) + tuple(q.shape[1:]), float("nan"), dtype=q.dtype)
    out[:q.shape[0]] = q
    return out


def sparse_backend(spec, **kw):
    return TritonMLABackend(spec, device="cpu", max_batch=4, capture_sizes=[4], next_n_max=2, max_blocks_per_seq=16,
                            topk_max=kw.pop("topk_max", 24),
                            config=DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1), **kw)


def test_ragged_buffers_stable_and_no_stale_tail():
    """Big step then small step into the same persistent buffers: addresses never move,
    every index position a row may read past its own entries is -1 (rewritten, not left
    over), padded rows read nothing, and the result equals the reference."""
    spec = ModelSpec.tiny(num_heads=2)
    be = sparse_backend(spec)
    gen = torch.Generator().manual_seed(5)
    big = make_case(spec, seq_lens=[60, 33, 50, 20], q_lens=[2, 2, 1, 2], s_q=2, page_size=4, kv_dtype="bf16", seed=1)
    small = make_case(spec, seq_lens=[7, 0], q_lens=[1, 0], s_q=2, page_size=4, kv_dtype="bf16", seed=2)
    md_big = be.build(ragged_batch(big, next_n=2, topk=24, pad_to=4, gen=gen))
    ptrs = {k: v.data_ptr() for k, v in md_big.tensors().items()}
    assert int((md_big.topk_indices >= 0).sum()) > 20  # the big step filled many positions
    batch = ragged_batch(small, next_n=2, topk=24, pad_to=4, gen=gen)
    md = be.build(batch)
    assert {k: v.data_ptr() for k, v in md.tensors().items()} == ptrs
    assert md.topk_indices.shape == (8, 24) and md.topk_indices.is_contiguous()
    expect, lens = TritonMLABackend.host_topk(batch, 4, 24)
    assert torch.equal(md.topk_indices, expect) and torch.equal(md.topk_length, lens)
    # row 0's own entries, then -1 through the whole row; every other row all -1
    n0 = int(batch.topk_indptr[1])
    assert torch.equal(md.topk_indices[0, :n0], batch.topk_flat[:n0])
    assert (md.topk_indices[0, n0:] == -1).all() and (md.topk_indices[1:] == -1).all()
    assert lens.tolist() == [24, 0, 0, 0]  # a request with real tokens reads topk entries per token
    out, lse = be.forward(padded(small.q, 4), small.kv_cache, md)
    ref = mla_ref.mla_decode(small.q, small.kv_cache, small.block_table, small.seq_lens, spec=spec,
                             q_lens=small.q_lens, indices=batch.dense_topk())
    assert_decode_close(out[:2], lse[:2], *ref, tol=TOL_INTERP[torch.bfloat16])
    assert (out[2:] == 0).all() and torch.isneginf(lse[2:]).all()
    assert md.topk_rows.tolist() == [24, 0, 0, 0, 0, 0, 0, 0]  # token 1 of request 0 is padding


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 16), st.sampled_from(["bf16", "fp8", "fp8_e4m3"]))
def test_ragged_backend_sequence_matches_reference(seed, kv):
    """Several steps of shrinking/growing nnz through one backend, each vs the reference."""
    spec = ModelSpec.tiny(num_heads=3)
    be = sparse_backend(spec)
    gen = torch.Generator().manual_seed(seed)
    for step in range(3):
        B = int(torch.randint(1, 5, (1,), generator=gen))
        seq = torch.randint(0, 40, (B,), generator=gen).tolist()
        ql = [min(int(torch.randint(0, 3, (1,), generator=gen)), s) for s in seq]
        case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=2, page_size=4, kv_dtype=kv, seed=seed + step)
        batch = ragged_batch(case, next_n=2, topk=int(torch.randint(1, 25, (1,), generator=gen)), pad_to=4, gen=gen,
                             kv_dtype=kv)
        md = be.build(batch)
        out, lse = be.forward(padded(case.q, 4), case.kv_cache, md)
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens, indices=batch.dense_topk(), k_scale=case.k_scale)
        assert_decode_close(out[:B], lse[:B], *ref, tol=TOL_INTERP[case.q.dtype], what=f"step {step} seq={seq}")


def test_ragged_backend_without_graph_safe_buffers_and_fewer_tokens_than_next_n():
    """``graph_safe=False`` (fresh tensors every build): a step whose requests carry fewer
    query tokens than ``next_n`` (``max_decode_len`` 1 of 2) still matches the reference. The
    per-token context lengths are read flat, ``pad * next_n`` of them, whatever the step's
    width (found by ``mla-fuzz run --graph eager``, seed 3: the view had ``pad * width``)."""
    spec = ModelSpec.tiny(num_heads=2)
    be = sparse_backend(spec, graph_safe=False)
    gen = torch.Generator().manual_seed(3)
    case = make_case(spec, seq_lens=[9, 30], q_lens=[1, 1], s_q=2, page_size=4, kv_dtype="bf16", seed=3)
    batch = ragged_batch(case, next_n=2, topk=8, pad_to=4, gen=gen)
    md = be.build(batch)
    assert tuple(md.ctx_lens.shape) == (4, 1) and md.ctx_lens.is_contiguous()
    out, lse = be.forward(padded(case.q, 4), case.kv_cache, md)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                             q_lens=case.q_lens, indices=batch.dense_topk())
    assert_decode_close(out[:2], lse[:2], *ref, tol=TOL_INTERP[torch.bfloat16])
    assert (out[2:] == 0).all() and torch.isneginf(lse[2:]).all()


def test_ragged_batch_validation_and_roundtrip():
    spec = ModelSpec.tiny(num_heads=2)
    case = make_case(spec, seq_lens=[5, 3], q_lens=[2, 1], s_q=2, page_size=4, kv_dtype="bf16")
    gen = torch.Generator().manual_seed(0)
    batch = ragged_batch(case, next_n=2, topk=4, pad_to=None, gen=gen)
    again = DecodeBatch.from_dict(batch.to_dict())
    assert torch.equal(again.topk_flat, batch.topk_flat) and torch.equal(again.topk_indptr, batch.topk_indptr)
    assert torch.equal(again.dense_topk(), batch.dense_topk())
    d = batch.to_dict()
    with pytest.raises(ValueError, match="topk_indptr must be"):
        DecodeBatch.from_dict({**d, "topk_indptr": d["topk_indptr"][:-1]})
    with pytest.raises(ValueError, match="<= topk"):
        DecodeBatch.from_dict({**d, "topk_flat": [1] * 5, "topk_indptr": [0, 5, 5, 5, 5]})
    with pytest.raises(ValueError, match="topk_max"):
        sparse_backend(spec, topk_max=2).build(batch)


# --------------------------------------------------------------------------- indexer

@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 16), st.sampled_from(["bf16", "fp8", "fp8_e4m3"]), st.sampled_from([1, 5, 64]),
       st.integers(1, 3), st.integers(1, 3))
def test_indexer_matches_reference(seed, kv, topk, s_q, width_less):
    """The device indexer picks exactly the reference's slots, in the same order, reading
    context lengths from a flat buffer whose row stride (max_decode_len) is a device value."""
    spec = ModelSpec.tiny(num_heads=3)
    gen = torch.Generator().manual_seed(seed)
    B = 3
    width = max(1, s_q - width_less + 1)  # max_decode_len <= s_q
    seq = torch.randint(0, 40, (B,), generator=gen).tolist()
    ql = [min(int(torch.randint(0, width + 1, (1,), generator=gen)), s) for s in seq]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=4, kv_dtype=kv, seed=seed)
    w = IndexerWeights.random(spec, seed)
    ref = mla_ref.indexer_topk(w, case.q, case.kv_cache, case.block_table, case.seq_lens, case.q_lens, topk,
                               spec=spec, k_scale=case.k_scale)
    flat = torch.full((B * s_q + 5,), 999, dtype=torch.int32)  # spare tail: never read
    ctx = flat[:B * width].view(B, width)
    ctx.copy_(host_context_lens(case.seq_lens, case.q_lens, width, B))
    out = torch.full((B, s_q, topk + 3), 7, dtype=torch.int32)
    indexer_topk(case.q, case.kv_cache, case.block_table, ctx, torch.tensor([width], dtype=torch.int32),
                 w.w_q, w.w_k, w.head_w, out, topk, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group,
                 k_scale=case.k_scale)
    assert torch.equal(out[:, :, :topk], ref)
    assert (out[:, :, topk:] == -1).all()
    # the reference itself: each real token picks min(topk, visible) distinct visible slots
    for b in range(B):
        for i in range(s_q):
            row = ref[b, i][ref[b, i] >= 0].tolist()
            vis = seq[b] - ql[b] + i + 1 if i < ql[b] else 0
            assert len(row) == min(topk, vis) and len(set(row)) == len(row)
            assert set(row) <= {case.slot(b, p) for p in range(vis)}


def test_indexer_rejects_noncontiguous_context_lens():
    spec = ModelSpec.tiny(num_heads=2)
    case = make_case(spec, seq_lens=[5, 3], q_lens=[1, 1], s_q=2, page_size=4, kv_dtype="bf16")
    w = IndexerWeights.random(spec, 0)
    two_d = torch.zeros(4, 2, dtype=torch.int32)[:2, :1]  # the vLLM #42135 view
    with pytest.raises(ValueError, match="ctx_lens must be contiguous"):
        indexer_topk(case.q, case.kv_cache, case.block_table, two_d, torch.ones(1, dtype=torch.int32),
                     w.w_q, w.w_k, w.head_w, torch.zeros(2, 2, 4, dtype=torch.int32), 4, 64, 16, 16)


def test_indexer_backend_step_matches_reference():
    """Whole sparse step: the backend's indexer selects on the device, then sparse decode;
    equal to the reference indexer + reference sparse decode."""
    spec = ModelSpec.tiny(num_heads=3)
    w = IndexerWeights.random(spec, 3)
    be = sparse_backend(spec, indexer=w)
    case = make_case(spec, seq_lens=[30, 2, 17], q_lens=[2, 1, 1], s_q=2, page_size=4, kv_dtype="bf16", seed=4)
    batch = DecodeBatch(seq_lens=case.seq_lens, q_lens=case.q_lens, block_table=case.block_table,
                        slot_mapping=torch.full((3, 2), -1, dtype=torch.int64), page_size=4, next_n=2, pad_to=4,
                        topk=9)
    assert batch.topk_on_device
    md = be.build(batch)
    out, lse = be.forward(padded(case.q, 4), case.kv_cache, md)
    sel = mla_ref.indexer_topk(w, case.q, case.kv_cache, case.block_table, case.seq_lens, case.q_lens, 9, spec=spec)
    assert torch.equal(md.topk_indices.view(4, 2, 24)[:3, :, :9], sel)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                             indices=sel)
    assert_decode_close(out[:3], lse[:3], *ref, tol=TOL_INTERP[torch.bfloat16])


# --------------------------------------------------------------------------- GPU, DeepSeek size

@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8_e4m3"])
@pytest.mark.parametrize("s_q", [1, 2])
def test_sparse_decode_deepseek_gpu(kv, s_q):
    """h=128, d_qk 576, topk 2048 (DeepSeek-V3.2), default launch config, vs the reference."""
    spec = ModelSpec(num_heads=128)
    seq = [5000, 2048, 700, 0]
    ql = [s_q, s_q, 1, 0]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=64, kv_dtype=kv, seed=3, device="cuda")
    cpu_case = type(case)(**{**case.__dict__, "block_table": case.block_table.cpu(), "seq_lens": case.seq_lens.cpu(),
                             "q_lens": case.q_lens.cpu()})
    idx = random_selection(cpu_case, s_q, 2048, torch.Generator().manual_seed(1)).cuda()
    tl = torch.tensor([2048, 2000, 2048, 5], dtype=torch.int32, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, indices=idx, topk_length=tl, k_scale=case.k_scale)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                             indices=idx, topk_length=tl, k_scale=case.k_scale)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=f"{kv} s_q={s_q}")


@pytest.mark.gpu
def test_sparse_backend_cuda_graph_gpu():
    """The ragged backend path captured in a real CUDA graph: replay of a second step with a
    different nnz equals its eager forward bitwise and the reference within tolerance."""
    spec = ModelSpec(num_heads=128)
    be = TritonMLABackend(spec, device="cuda", max_batch=4, capture_sizes=[4], next_n_max=2, max_blocks_per_seq=128,
                          topk_max=2048)
    gen = torch.Generator().manual_seed(0)
    cases = [make_case(spec, seq_lens=s, q_lens=[2, 1, 2], s_q=2, page_size=64, kv_dtype="bf16", seed=i)
             for i, s in enumerate(([4000, 100, 2500], [3000, 2048, 64]))]
    cache = torch.cat([c.kv_cache for c in cases]).cuda()  # pages of case 1 shifted by case 0's page count
    shift = cases[0].kv_cache.shape[0]
    cases[1].block_table += shift
    batches = [ragged_batch(c, next_n=2, topk=2048, pad_to=4, gen=gen) for c in cases]
    q = torch.zeros(4, 2, 128, spec.d_qk, dtype=torch.bfloat16, device="cuda")
    md = be.build(batches[0])
    q[:3].copy_(cases[0].q.nan_to_num(0.0))
    be.forward(q, cache, md)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = be.forward(q, cache, md)
    md2 = be.build(batches[1])
    q[:3].copy_(cases[1].q.nan_to_num(0.0))
    graph.replay()
    e_out, e_lse = be.forward(q, cache, md2)
    assert torch.equal(g_out[:3], e_out[:3]) and torch.equal(g_lse[:3], e_lse[:3])
    ref = mla_ref.mla_decode(q[:3], cache, cases[1].block_table.cuda(), cases[1].seq_lens.cuda(), spec=spec,
                             q_lens=cases[1].q_lens.cuda(), indices=batches[1].dense_topk().cuda())
    assert_decode_close(e_out[:3], e_lse[:3], *ref, tol=TOL_GPU[torch.bfloat16])
