"""The per-tensor FP8 cache (kv_dtype "fp8_e4m3") in our Triton backend: the split decode (split
requests included), the sparse decode and the cache write against mla_ref; the scale read from
its device tensor when the kernels run (what a replayed graph relies on); the backend's
persistent scale buffer; the device indexer; argument checks. CPU interpreter, DeepSeek size
on a GPU. (The property tests of tests/kernels/test_kernels_{decode,sparse,backend,cache_write}.py
draw fp8_e4m3 too.)"""
from __future__ import annotations

import pytest
import torch

from mla_fuzz import kernels, mla_ref
from mla_fuzz.kernels import DecodeConfig, SchedState, TritonMLABackend, default_config, ops
from mla_fuzz.mla_ref import DecodeBatch, IndexerWeights, ModelSpec
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, batch_of, make_case, spy_launches


def _padded(q, pad):
    out = torch.full((pad,) + tuple(q.shape[1:]), float("nan"), dtype=q.dtype, device=q.device)
    out[:q.shape[0]] = q
    return out


def _reference(case, k_scale=None, **kw):
    """``mla_ref.mla_decode`` of the case (at its own scale unless ``k_scale`` is given)."""
    return mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=case.spec,
                              q_lens=case.q_lens, k_scale=case.k_scale if k_scale is None else k_scale, **kw)


# --------------------------------------------------------------------------- dense split decode

@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_split_decode_splits_long_requests_and_matches_reference(q_dtype, monkeypatch, e4m3_nan):
    """The default CPU route (5 parts, 64-key tiles): a 300-key request among short ones is cut
    across parts (the plan says so) and merged; 12 heads x 3 tokens leave row blocks part-full;
    an empty request and a 1-key one; NaN codes (real NaN under ``e4m3_nan``) past every length.
    The launch reads the cache as fp8_e4m3 (not FlashMLA's FP8 path) on the Triton kernel."""
    import mla_fuzz.kernels.decode_split as ds
    seen = spy_launches(monkeypatch, ds, "_decode_split_kernel", "E4M3", "FP8", "GROUPED")
    spec = ModelSpec.tiny(num_heads=12)
    case = make_case(spec, seq_lens=[300, 0, 37, 1, 129], q_lens=[3, 0, 2, 1, 3], s_q=3, page_size=16,
                     kv_dtype="fp8_e4m3", q_dtype=q_dtype, seed=3, k_scale=0.037)
    cfg = default_config(spec, 3, torch.device("cpu"), fp8_e4m3=True, batch=5)
    assert cfg.kernel == "triton" and not cfg.fp8_grouped
    sched = SchedState(cfg)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, sched=sched, k_scale=case.k_scale)
    assert int(sched.num_splits.max()) > 1, sched.num_splits  # the planner split a request
    assert_decode_close(out, lse, *_reference(case), tol=TOL_INTERP[q_dtype], what=str(q_dtype))
    assert seen == [(True, False, False)]


def test_split_decode_small_blocks_every_cut_interpreter(e4m3_nan):
    """Small tiles and many parts: cuts inside requests at page and tile edges, pages of 4."""
    spec = ModelSpec.tiny(num_heads=3)
    case = make_case(spec, seq_lens=[70, 16, 17, 0, 33], q_lens=[4, 2, 1, 0, 3], s_q=4, page_size=4,
                     kv_dtype="fp8_e4m3", seed=9, k_scale=3.0)
    for parts in (1, 4, 7):
        cfg = DecodeConfig(block_m=16, block_n=16, num_parts=parts, min_tiles_per_part=1, num_stages=1)
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, config=cfg, k_scale=case.k_scale)
        assert_decode_close(out, lse, *_reference(case), tol=TOL_INTERP[torch.bfloat16], what=f"{parts} parts")


def test_saturated_and_large_scaled_values_match_reference():
    """Keys written past 448 * k_scale (saturated codes) and a scale far from 1 (values ~1e3):
    the kernel's fp32 ``e4m3 * k_scale`` is the reference's."""
    spec = ModelSpec.tiny(num_heads=4)
    case = make_case(spec, seq_lens=[40, 9], q_lens=[1, 1], s_q=1, page_size=8, kv_dtype="fp8_e4m3", seed=2,
                     k_scale=2.0 ** -8)  # randn / 2**-8 reaches past 448: saturated codes
    codes = case.kv_cache.view(torch.uint8) & 0x7F
    assert bool((codes == 0x7E).any())
    q = (case.q.float() * 1e-2).to(torch.bfloat16)
    big = torch.tensor([1000.0])
    for ks in (case.k_scale, big):
        out, lse = kernels.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, k_scale=ks)
        ref = mla_ref.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                                 k_scale=ks)
        out_tol = TOL_INTERP[torch.bfloat16]
        if ks is big:  # |lse| in the thousands: fp32 summation order alone moves it past 1e-4
            out_tol = (out_tol[0], out_tol[1], 1e-5 * float(ref[1][torch.isfinite(ref[1])].abs().max()))
        assert_decode_close(out, lse, *ref, tol=out_tol, what=f"k_scale {float(ks)}")


# --------------------------------------------------------------------------- the scale at launch time

def test_kernels_read_the_scale_when_they_run():
    """The same k_scale tensor changed in place between two calls: each call's result follows the
    value the tensor holds when it runs -- dense and sparse decode and the cache write (nothing
    caches the value on the host, so a captured graph would follow it too)."""
    spec = ModelSpec.tiny(num_heads=3)
    case = make_case(spec, seq_lens=[33, 7], q_lens=[2, 1], s_q=2, page_size=4, kv_dtype="fp8_e4m3", seed=5,
                     k_scale=0.05)
    ks = case.k_scale.clone()
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=1)
    idx = torch.full((2, 2, 8), -1, dtype=torch.int32)
    idx[0, 0, :5] = torch.tensor([case.slot(0, t) for t in (0, 3, 9, 30, 31)])
    idx[0, 1, :3] = torch.tensor([case.slot(0, t) for t in (1, 2, 32)])
    idx[1, 0, :4] = torch.tensor([case.slot(1, t) for t in (0, 6, 5, 4)])
    results = {}
    for value in (0.05, 0.4):
        ks.fill_(value)  # in place: same tensor, new value
        dense = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                   q_lens=case.q_lens, config=cfg, k_scale=ks)
        assert_decode_close(*dense, *_reference(case, k_scale=value), tol=TOL_INTERP[torch.bfloat16])
        sparse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                    q_lens=case.q_lens, indices=idx, config=cfg, k_scale=ks)
        assert_decode_close(*sparse, *_reference(case, k_scale=value, indices=idx), tol=TOL_INTERP[torch.bfloat16])
        results[value] = dense[0]
    assert not torch.equal(results[0.05], results[0.4])
    g = torch.Generator().manual_seed(1)
    lat, rope = torch.randn(3, spec.kv_lora_rank, generator=g), torch.randn(3, spec.qk_rope_head_dim, generator=g)
    slots = torch.tensor([0, 5, -1])
    for value in (0.05, 0.4):
        ks.fill_(value)
        ours = mla_ref.make_kv_cache(spec, 2, 4, "fp8_e4m3")
        ref = ours.clone()
        ops.write_kv_cache(ours, lat, rope, slots, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group,
                           k_scale=ks)
        mla_ref.write_kv_cache(ref, lat, rope, slots, spec=spec, k_scale=value)
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)), value


def test_backend_keeps_the_scale_in_one_persistent_buffer():
    """``build`` copies ``batch.k_scale`` (the engine's tensor) into a buffer allocated once: its
    address is the same for every build and is not the engine's tensor; ``forward`` reads the
    buffer when it runs, so a change made to it after the build (what a replay of a graph
    captured on an older build sees after the next build) is what the result follows; the
    engine's own in-place updates reach the kernels through the next build."""
    spec = ModelSpec.tiny(num_heads=2)
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=1)
    be = TritonMLABackend(spec, device="cpu", max_batch=4, capture_sizes=[4], next_n_max=2, max_blocks_per_seq=32,
                          config=cfg)
    assert "fp8_e4m3" in be.capabilities.kv_dtypes
    case = make_case(spec, seq_lens=[40, 3, 17], q_lens=[2, 1, 1], s_q=2, page_size=8, kv_dtype="fp8_e4m3",
                     seed=6, k_scale=0.02)
    engine_scale = torch.tensor([0.02])
    md = be.build(batch_of(case, kv_dtype="fp8_e4m3", next_n=2, pad_to=4, k_scale=engine_scale))
    buf = md.k_scale
    assert buf.dtype == torch.float32 and tuple(buf.shape) == (1,) and float(buf) == float(engine_scale)
    assert buf.data_ptr() != engine_scale.data_ptr() and "k_scale" in md.tensors()
    q = _padded(case.q, 4)
    out, lse = be.forward(q, case.kv_cache, md)
    assert_decode_close(out[:3], lse[:3], *_reference(case, k_scale=0.02), tol=TOL_INTERP[torch.bfloat16])
    assert (out[3:] == 0).all() and torch.isneginf(lse[3:]).all()
    buf.fill_(0.3)  # after the build: the forward reads the buffer, not a build-time value
    out, lse = be.forward(q, case.kv_cache, md)
    assert_decode_close(out[:3], lse[:3], *_reference(case, k_scale=0.3), tol=TOL_INTERP[torch.bfloat16])
    engine_scale.fill_(0.11)  # the engine updates its tensor in place, then builds the next step
    md2 = be.build(batch_of(case, kv_dtype="fp8_e4m3", next_n=2, pad_to=4, k_scale=engine_scale))
    assert md2.k_scale.data_ptr() == buf.data_ptr() and float(md2.k_scale) == float(engine_scale)
    assert {k: v.data_ptr() for k, v in md2.tensors().items()} == {k: v.data_ptr() for k, v in md.tensors().items()}
    out, lse = be.forward(q, case.kv_cache, md2)
    assert_decode_close(out[:3], lse[:3], *_reference(case, k_scale=0.11), tol=TOL_INTERP[torch.bfloat16])
    # the layer path's cache write quantises with the build's scale
    g = torch.Generator().manual_seed(2)
    lat = torch.randn(4, 2, spec.kv_lora_rank, generator=g)
    rope = torch.randn(4, 2, spec.qk_rope_head_dim, generator=g)
    ours, ref = case.kv_cache.clone(), case.kv_cache.clone()
    be.write_kv(ours, lat, rope, md2)
    mla_ref.write_kv_cache(ref, lat.reshape(8, -1), rope.reshape(8, -1), md2.slot_mapping.view(-1), spec=spec,
                           k_scale=0.11)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    # other caches carry no scale
    bf16 = make_case(spec, seq_lens=[5], q_lens=[1], s_q=1, page_size=8, kv_dtype="bf16")
    plain = DecodeBatch(seq_lens=bf16.seq_lens, q_lens=bf16.q_lens, block_table=bf16.block_table,
                        slot_mapping=torch.full((1, 1), -1, dtype=torch.int64), page_size=8)
    assert be.build(plain).k_scale is None


def test_backend_sparse_step_with_device_indexer_matches_reference():
    """Sparse decode with the top-k selected on the device by the indexer, from an fp8_e4m3
    cache: the selection is the reference indexer's (on the same scale), the output the
    reference sparse decode's."""
    spec = ModelSpec.tiny(num_heads=3)
    w = IndexerWeights.random(spec, 3)
    be = TritonMLABackend(spec, device="cpu", max_batch=4, capture_sizes=[4], next_n_max=2, max_blocks_per_seq=16,
                          topk_max=24, indexer=w,
                          config=DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1))
    case = make_case(spec, seq_lens=[30, 2, 17], q_lens=[2, 1, 1], s_q=2, page_size=4, kv_dtype="fp8_e4m3", seed=4,
                     k_scale=0.06)
    batch = DecodeBatch(seq_lens=case.seq_lens, q_lens=case.q_lens, block_table=case.block_table,
                        slot_mapping=torch.full((3, 2), -1, dtype=torch.int64), page_size=4, next_n=2, pad_to=4,
                        topk=9, kv_dtype="fp8_e4m3", k_scale=case.k_scale)
    md = be.build(batch)
    out, lse = be.forward(_padded(case.q, 4), case.kv_cache, md)
    sel = mla_ref.indexer_topk(w, case.q, case.kv_cache, case.block_table, case.seq_lens, case.q_lens, 9, spec=spec,
                               k_scale=case.k_scale)
    assert torch.equal(md.topk_indices.view(4, 2, 24)[:3, :, :9], sel)
    assert_decode_close(out[:3], lse[:3], *_reference(case, indices=sel), tol=TOL_INTERP[torch.bfloat16])


# --------------------------------------------------------------------------- argument checks

def test_ops_require_k_scale_for_fp8_e4m3_and_refuse_it_otherwise():
    spec = ModelSpec.tiny(num_heads=2)
    case = make_case(spec, seq_lens=[5, 3], q_lens=[1, 1], s_q=1, page_size=4, kv_dtype="fp8_e4m3")
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens)
    with pytest.raises(ValueError, match="k_scale is required"):
        kernels.mla_decode(*args, spec=spec)
    with pytest.raises(ValueError, match="k_scale must have dtype float32"):
        kernels.mla_decode(*args, spec=spec, k_scale=case.k_scale.double())
    with pytest.raises(ValueError, match=r"k_scale must have shape \[1\]"):
        kernels.mla_decode(*args, spec=spec, k_scale=torch.ones(2))
    with pytest.raises(ValueError, match="k_scale is required"):
        ops.write_kv_cache(case.kv_cache, torch.zeros(1, 64), torch.zeros(1, 16), torch.zeros(1, dtype=torch.int64),
                           64, 16, 16)
    with pytest.raises(ValueError, match="k_scale is required"):
        kernels.mla_decode(*args, spec=spec, indices=torch.zeros(2, 1, 3, dtype=torch.int32))
    bf16 = make_case(spec, seq_lens=[5, 3], q_lens=[1, 1], s_q=1, page_size=4, kv_dtype="bf16")
    with pytest.raises(ValueError, match="k_scale is only for an fp8_e4m3"):
        kernels.mla_decode(bf16.q, bf16.kv_cache, bf16.block_table, bf16.seq_lens, spec=spec, k_scale=torch.ones(1))
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        kernels.mla_decode(case.q, case.kv_cache[..., :40].contiguous(), case.block_table, case.seq_lens, spec=spec,
                           k_scale=case.k_scale)
    be = TritonMLABackend(spec, device="cpu", max_batch=2, next_n_max=1, max_blocks_per_seq=4)
    md = be.build(batch_of(case, kv_dtype="fp8_e4m3", next_n=1))
    with pytest.raises(ValueError, match="kv_dtype"):
        be.forward(case.q, bf16.kv_cache, md)  # the batch said fp8_e4m3


# --------------------------------------------------------------------------- GPU, DeepSeek size

@pytest.mark.gpu
@pytest.mark.parametrize("capability", [None, (8, 0)], ids=["this-gpu", "pre-hopper-route"])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (16, 2), (128, 1), (128, 2), (20, 4)])
def test_fp8_e4m3_default_routes_match_reference_gpu(heads, s_q, capability):
    """The default route of each shape (the Triton kernel, on Hopper too) at DeepSeek size: a
    long request split over many parts, lengths around tile and page edges, an empty request,
    NaN codes past every length; and the sparse decode of the same cache. ``capability (8, 0)``
    runs the blocks a pre-Hopper GPU gets (the "cuda" rows) on this one."""
    spec = ModelSpec(num_heads=heads)
    seq = [9000, 1, 0, 63, 64, 65, 2000]
    ql = [s_q, 1, 0, 1, min(s_q, 64), s_q, s_q]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=64, kv_dtype="fp8_e4m3", seed=23,
                     device="cuda", k_scale=0.03)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8_e4m3=True, batch=len(seq), capability=capability)
    assert cfg.kernel == "triton"
    sched = SchedState(cfg)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, sched=sched, k_scale=case.k_scale)
    assert int(sched.num_splits.max()) > 1
    assert_decode_close(out, lse, *_reference(case), tol=TOL_GPU[torch.bfloat16], what=f"h={heads} s_q={s_q}")
    g = torch.Generator().manual_seed(1)
    idx = torch.full((len(seq), s_q, 512), -1, dtype=torch.int32)
    for b, L in enumerate(seq):
        for i in range(ql[b]):
            vis = L - ql[b] + i + 1
            pick = torch.randperm(vis, generator=g)[:512].tolist()
            idx[b, i, :len(pick)] = torch.tensor([case.slot(b, p) for p in pick], dtype=torch.int32)
    idx = idx.cuda()
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, indices=idx, k_scale=case.k_scale)
    assert_decode_close(out, lse, *_reference(case, indices=idx), tol=TOL_GPU[torch.bfloat16], what="sparse")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,next_n", [(16, 1), (128, 2)])
def test_fp8_e4m3_cuda_graph_replays_follow_the_engine_scale_gpu(heads, next_n):
    """A real CUDA graph captured on one build: later steps change the engine's ``k_scale`` in
    place (and the batch) and build; each replay equals an eager forward bitwise and the
    reference at the new scale -- the graph reads the persistent buffer, never a capture-time
    value. The layer's cache write (``write_kv``) is captured and replayed too."""
    spec = ModelSpec(num_heads=heads)
    be = TritonMLABackend(spec, device="cuda", max_batch=4, capture_sizes=[4], next_n_max=next_n,
                          max_blocks_per_seq=64)
    engine_scale = torch.tensor([0.03], device="cuda")
    cases = [make_case(spec, seq_lens=s, q_lens=[min(x, next_n) for x in q], s_q=next_n, page_size=64,
                       kv_dtype="fp8_e4m3", seed=i, device="cuda", k_scale=k)
             for i, (s, q, k) in enumerate([([100, 5, 3000], [2, 1, 2], 0.03), ([2500, 0, 9, 64], [1, 0, 2, 2], 0.2),
                                            ([1, 1800], [1, 2], 0.005)])]
    cache = torch.zeros(max(c.kv_cache.shape[0] for c in cases), *cases[0].kv_cache.shape[1:],
                        dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    q = _padded(cases[0].q, 4)
    md = be.build(batch_of(cases[0], kv_dtype="fp8_e4m3", next_n=next_n, pad_to=4, k_scale=engine_scale))
    cache.view(torch.uint8)[:cases[0].kv_cache.shape[0]] = cases[0].kv_cache.view(torch.uint8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        be.forward(q, cache, md)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = be.forward(q, cache, md)
    for case in cases[1:] + cases[:1]:
        engine_scale.copy_(case.k_scale)
        md = be.build(batch_of(case, kv_dtype="fp8_e4m3", next_n=next_n, pad_to=4, k_scale=engine_scale))
        q.copy_(_padded(case.q, 4))
        cache.view(torch.uint8)[:case.kv_cache.shape[0]] = case.kv_cache.view(torch.uint8)
        graph.replay()
        e_out, e_lse = be.forward(q, cache, md)
        torch.cuda.synchronize()
        assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)
        B = case.batch
        assert_decode_close(g_out[:B], g_lse[:B], *_reference(case), tol=TOL_GPU[torch.bfloat16],
                            what=f"k_scale {float(case.k_scale)}")

