"""TritonMLABackend and MLADecodeLayer: address stability, padding isolation, layer == reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import MLALayerWeights, ModelSpec

from mla_fuzz import kernels
from mla_fuzz.harness.layer import MLADecodeLayer, decode_positions
from mla_fuzz.kernels import DecodeConfig, TritonMLABackend, ops, routes
from mla_fuzz.kernels.routes import SPLIT_ROWS_MAX_BATCH
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, batch_of, lens_strategy, make_case

CFG = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1)


def padded_q(case, pad):
    """q padded to ``pad`` rows of NaN (stale pool memory)."""
    B = case.batch
    q = torch.full((pad,) + tuple(case.q.shape[1:]), float("nan"), dtype=case.q.dtype, device=case.q.device)
    q[:B] = case.q
    return q


def make_backend(spec, device="cpu", **kw):
    kw.setdefault("config", CFG if torch.device(device).type == "cpu" else None)
    return TritonMLABackend(spec, device=device, max_batch=kw.pop("max_batch", 8),
                            capture_sizes=kw.pop("capture_sizes", [4, 8]), next_n_max=kw.pop("next_n_max", 4),
                            max_blocks_per_seq=kw.pop("max_blocks_per_seq", 32), **kw)


def test_metadata_addresses_stable_across_builds():
    spec = ModelSpec.tiny(num_heads=2)
    be = make_backend(spec)
    shapes = [([5, 1, 40], [1, 1, 2], 2, 4), ([17], [1], 1, 8), ([0, 9, 33, 2, 64], [0, 3, 1, 2, 4], 4, 5),
              ([8, 8], [2, 1], 3, None)]
    first = None
    for i, (seq, ql, next_n, pad) in enumerate(shapes):
        case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=next_n, page_size=8, kv_dtype="bf16", seed=i)
        md = be.build(batch_of(case, next_n=next_n, pad_to=pad))
        ptrs = {k: v.data_ptr() for k, v in md.tensors().items()}
        assert set(ptrs) == {"seq_lens", "block_table", "ctx_lens", "ctx_width", "slot_mapping", "part_info",
                             "num_splits", "split_offsets"}
        assert md.ctx_lens.is_contiguous() and md.ctx_lens.shape == (md.padded_size, md.max_decode_len)
        first = first or ptrs
        assert ptrs == first, f"build {i} moved {[k for k in ptrs if ptrs[k] != first[k]]}"
    # the same audit sees fresh tensors when the backend is not graph safe
    loose = make_backend(spec, graph_safe=False)
    case = make_case(spec, seq_lens=[5], q_lens=[1], s_q=1, page_size=8, kv_dtype="bf16")
    a = loose.build(batch_of(case, next_n=1)).tensors()
    keep_alive = a
    b = loose.build(batch_of(case, next_n=1)).tensors()
    assert any(a[k].data_ptr() != b[k].data_ptr() for k in a) and keep_alive


@st.composite
def padded_case(draw):
    heads = draw(st.sampled_from([2, 5]))
    next_n = draw(st.integers(1, 3))
    seq, ql = draw(lens_strategy(max_batch=3, max_len=50, s_q=next_n, page_size=8))
    extra = draw(st.integers(0, 3))
    width = draw(st.integers(max(ql + [0]), next_n))  # max_decode_len may be < next_n
    kv = draw(st.sampled_from(["bf16", "fp8", "fp8_e4m3"]))
    seed = draw(st.integers(0, 2 ** 16))
    return heads, next_n, seq, ql, extra, width, kv, seed


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(padded_case())
def test_padding_never_reaches_real_rows(args):
    heads, next_n, seq, ql, extra, width, kv, seed = args
    spec = ModelSpec.tiny(num_heads=heads)
    be = make_backend(spec)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=next_n, page_size=8, kv_dtype=kv, seed=seed)
    B, pad = len(seq), len(seq) + extra
    md = be.build(batch_of(case, next_n=next_n, pad_to=pad, kv_dtype=kv, max_decode_len=width))
    assert md.block_table[B:].eq(case.null_block).all() and md.seq_lens[B:].eq(0).all()
    assert md.slot_mapping[B:].eq(-1).all()
    # poison the output buffer too: every row must be written
    out = torch.full((pad, next_n, heads, spec.kv_lora_rank), float("nan"), dtype=case.q.dtype)
    out, lse = be.forward(padded_q(case, pad), case.kv_cache, md, out=out)
    assert (out[B:] == 0).all() and torch.isneginf(lse[B:]).all()
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                             k_scale=case.k_scale)
    assert_decode_close(out[:B], lse[:B], *ref, tol=TOL_INTERP[case.q.dtype], what=f"seq={seq} ql={ql} pad={pad}")
    # padded rows have no tiles, so the plan for real rows is the same: bitwise equal
    md0 = be.build(batch_of(case, next_n=next_n, kv_dtype=kv, max_decode_len=width))
    out0, lse0 = be.forward(case.q, case.kv_cache, md0)
    assert torch.equal(out0, out[:B]) and torch.equal(lse0, lse[:B])


def test_forward_is_deterministic_and_replans():
    spec = ModelSpec.tiny(num_heads=3)
    be = make_backend(spec)
    case = make_case(spec, seq_lens=[30, 3, 47], q_lens=[2, 1, 2], s_q=2, page_size=8, kv_dtype="bf16", seed=4)
    md = be.build(batch_of(case, next_n=2, pad_to=4))
    q = padded_q(case, 4)
    a = be.forward(q, case.kv_cache, md)
    md.part_info.fill_(-1)  # a forward must re-plan, never trust what the buffers hold
    b = be.forward(q, case.kv_cache, md)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_default_configs_follow_the_padded_batch(monkeypatch):
    """Without a given config the backend asks ``default_config`` per next_n, kv dtype and
    padded batch size (its ``batch``): each build runs the config of its padded size, and the
    forward matches the reference under each; the persistent plan buffer is sized for the
    largest of the defaults at batch None, 1 and max_batch, and a default past it is refused
    rather than overrunning it. A given config serves every batch."""
    import mla_fuzz.kernels.backend as kb
    asked = []

    def fake(spec, s_q, device=None, *, fp8=False, sparse=False, batch=None, fp8_e4m3=False):
        asked.append(batch)
        parts = 9 if batch == 6 else (2 if batch is not None and batch <= 4 else 3)
        return DecodeConfig(block_m=16, block_n=16, num_parts=parts, min_tiles_per_part=1)

    monkeypatch.setattr(kb, "default_config", fake)
    spec = ModelSpec.tiny(num_heads=3)
    be = make_backend(spec, config=None)
    assert {None, 1, 8} <= set(asked)
    case = make_case(spec, seq_lens=[30, 3, 47], q_lens=[2, 1, 2], s_q=2, page_size=8, kv_dtype="bf16", seed=5)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    for pad, parts in ((4, 2), (8, 3)):
        md = be.build(batch_of(case, next_n=2, pad_to=pad))
        assert md.config.num_parts == parts and md.config is be.config_for(2, "bf16", pad)
        out, lse = be.forward(padded_q(case, pad), case.kv_cache, md)
        assert_decode_close(out[:3], lse[:3], *ref, tol=TOL_INTERP[torch.bfloat16], what=f"pad {pad}")
    with pytest.raises(RuntimeError, match="9 parts"):
        be.build(batch_of(case, next_n=2, pad_to=6))
    given = make_backend(spec, config=CFG)
    assert all(given.config_for(2, "bf16", b) is CFG for b in (None, 1, 4, 8))


def test_build_and_forward_reject_bad_input():
    spec = ModelSpec.tiny(num_heads=2)
    be = make_backend(spec, max_batch=4, capture_sizes=[4], next_n_max=2, page_size=8)
    case = make_case(spec, seq_lens=[5, 9], q_lens=[1, 1], s_q=2, page_size=8, kv_dtype="bf16")
    with pytest.raises(ValueError, match="max_batch"):
        be.build(batch_of(case, next_n=2, pad_to=5))
    case3 = make_case(spec, seq_lens=[5], q_lens=[1], s_q=3, page_size=8, kv_dtype="bf16")
    with pytest.raises(ValueError, match="next_n_max"):
        be.build(batch_of(case3, next_n=3))
    case4 = make_case(spec, seq_lens=[5], q_lens=[1], s_q=1, page_size=4, kv_dtype="bf16")
    with pytest.raises(ValueError, match="page_size"):
        be.build(batch_of(case4, next_n=1))
    md = be.build(batch_of(case, next_n=2, pad_to=4))
    with pytest.raises(ValueError, match="q must be"):
        be.forward(case.q, case.kv_cache, md)
    with pytest.raises(ValueError, match="kv_dtype"):
        be.forward(padded_q(case, 4), case.kv_cache.half(), md)
    with pytest.raises(ValueError, match="capture_sizes"):
        TritonMLABackend(spec, device="cpu", max_batch=4, capture_sizes=[8])


def test_noncontiguous_context_lens_rejected():
    """vLLM #42135's view — ``[:B, :max_decode_len]`` of a ``[max_batch, next_n]`` buffer — is
    refused at the kernel's entry (the kernel indexes the context lengths flat)."""
    spec = ModelSpec.tiny(num_heads=2)
    be = make_backend(spec)
    case = make_case(spec, seq_lens=[12, 20], q_lens=[1, 2], s_q=3, page_size=8, kv_dtype="bf16")
    md = be.build(batch_of(case, next_n=3, max_decode_len=2))
    wide = torch.zeros(8, 3, dtype=torch.int32)
    view = wide[:2, :2]
    view.copy_(md.ctx_lens)
    assert not view.is_contiguous()
    po, plse = kernels.decode.alloc_partials(md.config, 3, 2, spec.kv_lora_rank, torch.device("cpu"))
    out = torch.empty(2, 3, 2, spec.kv_lora_rank, dtype=torch.bfloat16)
    lse = torch.empty(2, 2, 3)
    with pytest.raises(ValueError, match="ctx_lens must be contiguous"):
        ops.decode_split(case.q, case.kv_cache, md.block_table, md.seq_lens, view, md.ctx_width, md.part_info,
                         md.num_splits, md.split_offsets, out, lse, po, plse, spec.softmax_scale, spec.kv_lora_rank,
                         spec.qk_rope_head_dim, spec.fp8_group, 16, 16, 4, 1)


def test_decode_positions():
    seq = torch.tensor([10, 3, 0], dtype=torch.int32)
    ql = torch.tensor([2, 3, 0], dtype=torch.int32)
    pos = decode_positions(seq, ql, 3, pad=4)
    assert pos.dtype == torch.int64 and pos.shape == (4, 3)
    assert pos[0, :2].tolist() == [8, 9] and pos[1].tolist() == [0, 1, 2]


def _layer_check(spec, kv, fp8_out, device, seq, ql, next_n, pad, tol):
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=next_n, page_size=16, kv_dtype=kv, seed=9, device=device)
    be = make_backend(spec, device=device, max_blocks_per_seq=max(8, case.block_table.shape[1]))
    batch = batch_of(case, next_n=next_n, pad_to=pad, kv_dtype=kv)
    md = be.build(batch)
    w = MLALayerWeights.random(spec, seed=2, dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(pad, next_n, spec.hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    hidden[len(seq):] = float("nan")  # padded rows: stale pool memory
    pos = decode_positions(case.seq_lens, case.q_lens, next_n, pad=pad)
    ours_cache, ref_cache = case.kv_cache.clone(), case.kv_cache.clone()
    y = MLADecodeLayer(spec, w, be)(hidden, pos, ours_cache, md, fp8_out=fp8_out)
    B = len(seq)
    y_ref = mla_ref.mla_layer_decode_absorbed(w, hidden[:B], pos[:B], ref_cache, case.block_table, case.seq_lens,
                                              batch.slot_mapping.to(device), spec=spec, q_lens=case.q_lens,
                                              fp8_out=fp8_out, k_scale=case.k_scale)
    assert torch.isfinite(y[:B]).all()
    err = (y[:B].float() - y_ref.float()).abs().max().item()
    assert err <= tol * max(1.0, y_ref.float().abs().max().item()), f"layer error {err}"
    assert torch.equal(ours_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "cache writes differ"


@pytest.mark.parametrize("kv,fp8_out", [("bf16", False), ("bf16", True), ("fp8", True), ("fp8_e4m3", True)])
def test_layer_matches_reference(kv, fp8_out):
    # interpreter: fp32 dots like the reference; the bf16 activations round identically
    _layer_check(ModelSpec.tiny(num_heads=5), kv, fp8_out, "cpu", seq=[7, 1, 33], ql=[2, 1, 1], next_n=2, pad=5,
                 tol=1e-2)


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8_e4m3"])
def test_layer_matches_reference_gpu(kv):
    _layer_check(ModelSpec(), kv, True, "cuda", seq=[700, 1, 2000, 64], ql=[2, 1, 2, 1], next_n=2, pad=8, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,next_n,pad", [(16, 1, 4), (16, 2, 4), (16, 2, 16), (128, 2, 4)])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_cuda_graph_replay_follows_new_builds(kv, heads, next_n, pad, monkeypatch):
    """Capture forward once; replays after new builds must equal eager forwards bitwise, with the
    kernels launched with programmatic dependent launch where the device has it (Hopper: each
    waits for the previous grid inside the kernel, kernels/hopper/pdl.py). On Hopper the routes
    (kernels/routes.py) give bf16 h=128 the ping-pong 64-row kernel (wgmma_pp), FP8 h=128 and
    h=16 x 2 padded to 16 requests the warp-specialised 64-row one (wgmma_ws64); FP8 h=16 x 1, and
    x 2 padded to 4 (two 16-row blocks, routes.SPLIT_ROWS_MAX_BATCH), the register-operand
    few-row one (wgmma_rs), bf16 h=16 x 1 and x 2 the TMA keys-on-M one (wgmma_kt), in two 16-row
    blocks at 4 -- asserted."""
    launched = []
    for name, real in list(routes.LAUNCHERS.items()):
        monkeypatch.setitem(routes.LAUNCHERS, name, lambda *a, _real=real, _name=name, **k: (launched.append(_name),
                                                                                            _real(*a, **k))[1])
    spec = ModelSpec(num_heads=heads)
    be = make_backend(spec, device="cuda", max_blocks_per_seq=64, next_n_max=next_n, max_batch=pad,
                      capture_sizes=[pad])
    cases = [make_case(spec, seq_lens=s, q_lens=[min(x, next_n) for x in q], s_q=next_n, page_size=64, kv_dtype=kv,
                       seed=i, device="cuda")
             for i, (s, q) in enumerate([([100, 5, 3000], [2, 1, 2]), ([2500, 0, 9, 64], [1, 0, 2, 2]),
                                         ([1, 1800], [1, 2])])]
    # one cache holding every case: copy each case's pages in before its step
    md = be.build(batch_of(cases[0], next_n=next_n, pad_to=pad, kv_dtype=kv))
    q_buf = padded_q(cases[0], pad)
    cache_buf = torch.zeros(max(c.kv_cache.shape[0] for c in cases), *cases[0].kv_cache.shape[1:],
                            dtype=cases[0].kv_cache.dtype, device="cuda")
    cache_buf[:cases[0].kv_cache.shape[0]] = cases[0].kv_cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        be.forward(q_buf, cache_buf, md)  # warmup (compiles) on the same build as the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = be.forward(q_buf, cache_buf, md)
    for case in cases[1:] + cases[:1]:
        md = be.build(batch_of(case, next_n=next_n, pad_to=pad, kv_dtype=kv))
        q_buf.copy_(padded_q(case, pad))
        cache_buf[:case.kv_cache.shape[0]] = case.kv_cache
        graph.replay()
        e_out, e_lse = be.forward(q_buf, cache_buf, md)
        torch.cuda.synchronize()
        assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)
        B = case.batch
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens)
        assert_decode_close(g_out[:B], g_lse[:B], *ref, tol=TOL_GPU[torch.bfloat16])
    if torch.cuda.get_device_capability()[0] == 9:
        if kv == "fp8":
            rs = heads * next_n <= 16 or (heads * next_n <= 32 and pad <= SPLIT_ROWS_MAX_BATCH)
            want = {"wgmma_rs" if rs else "wgmma_ws64"}
        else:  # bf16 at up to 32 rows: the TMA keys-on-M kernel
            # (4 padded requests: h=128 x 2 is 16 (request, row block) pairs)
            want = ({"wgmma_pp"} if heads * next_n > 64 else {"wgmma_kt"} if heads * next_n <= 32 else {"wgmma"})
        assert set(launched) == want, launched
        split = heads * next_n == 32 and pad <= SPLIT_ROWS_MAX_BATCH
        assert md.config.block_m == (16 if split or heads * next_n <= 16 else 32 if kv == "bf16" and heads == 16
                                     else 64), md.config


def test_decode_op_rejects_bad_plan_buffers():
    """The plan buffers handed to ``mla_fuzz::decode_split`` are checked at its entry, with
    the expected shape in the message (a short num_splits would be read past its end)."""
    spec = ModelSpec.tiny(num_heads=2)
    be = make_backend(spec)
    case = make_case(spec, seq_lens=[12, 20], q_lens=[1, 2], s_q=2, page_size=8, kv_dtype="bf16")
    md = be.build(batch_of(case, next_n=2))
    po, plse = kernels.decode.alloc_partials(md.config, 2, 2, spec.kv_lora_rank, torch.device("cpu"))
    out = torch.empty(2, 2, 2, spec.kv_lora_rank, dtype=torch.bfloat16)
    lse = torch.empty(2, 2, 2)

    def call(part_info=md.part_info, num_splits=md.num_splits, split_offsets=md.split_offsets):
        ops.decode_split(case.q, case.kv_cache, md.block_table, md.seq_lens, md.ctx_lens, md.ctx_width, part_info,
                         num_splits, split_offsets, out, lse, po, plse, spec.softmax_scale, spec.kv_lora_rank,
                         spec.qk_rope_head_dim, spec.fp8_group, 16, 16, 4, 1)

    with pytest.raises(ValueError, match=r"num_splits must have shape \[B=2\] int32"):
        call(num_splits=md.num_splits[:1])
    with pytest.raises(ValueError, match=r"split_offsets must have dtype int32"):
        call(split_offsets=md.split_offsets.long())
    with pytest.raises(ValueError, match=r"part_info must have num_parts \+ 1 >= 2 rows"):
        call(part_info=md.part_info[:1])
    call()  # the same buffers, untouched, are accepted
