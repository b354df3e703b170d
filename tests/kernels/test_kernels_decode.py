"""mla_fuzz.kernels.mla_decode against mla_ref.mla_decode (CPU interpreter; DeepSeek size on GPU)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import ModelSpec

from mla_fuzz import kernels
from mla_fuzz.kernels import DecodeConfig, SchedState, default_config
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, lens_strategy, make_case, spy_launches

# small launch configs that force splits (few parts, 1 tile each minimum) or none (and the FP8
# load variants: plain loads, twin loads with num_stages >= 2; both FP8 paths)
_CPU_CONFIGS = [DecodeConfig(block_m=16, block_n=16, num_parts=p, min_tiles_per_part=m, num_stages=st, fp8_grouped=g)
                for p, m, st, g in ((1, 1, 1, True), (3, 1, 1, False), (5, 2, 1, True), (7, 1, 1, False),
                                    (4, 1, 2, True))]


@st.composite
def cpu_case(draw):
    heads = draw(st.sampled_from([1, 3, 8, 12]))  # 3 and 12: row blocks of 16 straddle heads/tokens
    s_q = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 4, 8, 16]))
    seq, ql = draw(lens_strategy(max_batch=4, max_len=70, s_q=s_q, page_size=page))
    kv = draw(st.sampled_from(["bf16", "fp16", "fp8", "fp8_e4m3"]))
    q_dtype = draw(st.sampled_from([None, torch.float32]))
    cfg = draw(st.sampled_from(_CPU_CONFIGS))
    seed = draw(st.integers(0, 2 ** 16))
    return heads, s_q, page, seq, ql, kv, q_dtype, cfg, seed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cpu_case())
def test_decode_matches_reference_interpreter(args):
    heads, s_q, page, seq, ql, kv, q_dtype, cfg, seed = args
    spec = ModelSpec.tiny(num_heads=heads)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, q_dtype=q_dtype, seed=seed)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg, k_scale=case.k_scale)
    ref_out, ref_lse = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens, k_scale=case.k_scale)
    assert_decode_close(out, lse, ref_out, ref_lse, tol=TOL_INTERP[case.q.dtype],
                        what=f"h={heads} s_q={s_q} page={page} seq={seq} ql={ql} {kv} {cfg.num_parts} parts")


def test_decode_non_causal_and_scale_interpreter():
    spec = ModelSpec.tiny(num_heads=3)
    case = make_case(spec, seq_lens=[9, 23], q_lens=[2, 2], s_q=2, page_size=8, kv_dtype="bf16", seed=3)
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1)
    for causal in (False, True):
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, causal=causal, softmax_scale=0.3, config=cfg)
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens, causal=causal, softmax_scale=0.3)
        assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what=f"causal={causal}")


def _zero_scales(case, spec, b, first, last):
    """Zero the FP8 scale words of request b's keys first..last-1 in place (all-zero groups)."""
    rank, groups = spec.kv_lora_rank, spec.kv_lora_rank // spec.fp8_group
    for t in range(first, last):
        slot = case.slot(b, t)
        case.kv_cache[slot // case.page_size, slot % case.page_size, rank:rank + 4 * groups] = 0


def _check_bf16_and_fp32_q(case, spec, cfg, what):
    """The case's decode with ``cfg`` against the reference, for bf16 and fp32 queries."""
    for q_dtype in (torch.bfloat16, torch.float32):
        q = case.q.to(q_dtype)
        out, lse = kernels.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, config=cfg)
        ref_out, ref_lse = mla_ref.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                              q_lens=case.q_lens)
        assert_decode_close(out, lse, ref_out, ref_lse, tol=TOL_INTERP[q_dtype], what=f"{what} {q_dtype}")


# (DecodeConfig.fp8_grouped, num_stages): every FP8 code path of the pointer loads on the tiny spec
# (the interpreter ignores num_stages; 2 selects the twin loads of the grouped path)
_FP8_PATHS = {"grouped": (True, 1), "grouped-twin": (True, 2), "dequant": (False, 1)}


@pytest.mark.parametrize("path", list(_FP8_PATHS))
def test_decode_fp8_paths_interpreter(path, monkeypatch):
    """Each FP8 path against the reference on the edges: 3 x 12 = 36 query rows (row blocks
    of 16 straddle tokens and end part-full), requests split across parts, an empty request,
    a 1-key one, and keys whose scale words are all zero; the launch takes the path asked for."""
    import mla_fuzz.kernels.decode_split as ds
    grouped, stages = _FP8_PATHS[path]
    seen = spy_launches(monkeypatch, ds, "_decode_split_kernel", "GROUPED", "TWIN")
    spec = ModelSpec.tiny(num_heads=12)
    assert ds.fp8_grouped_dots(spec.kv_lora_rank, spec.fp8_group)
    case = make_case(spec, seq_lens=[37, 0, 70, 1, 16], q_lens=[3, 0, 2, 1, 3], s_q=3, page_size=4,
                     kv_dtype="fp8", seed=5)
    _zero_scales(case, spec, 0, 5, 21)
    _zero_scales(case, spec, 4, 0, 16)  # every key of request 4
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=5, min_tiles_per_part=1, num_stages=stages,
                       fp8_grouped=grouped)
    _check_bf16_and_fp32_q(case, spec, cfg, path)
    assert seen == [(grouped, grouped and stages >= 2)] * 2


@pytest.mark.parametrize("group", [8, 32, 64])
def test_decode_fp8_group_counts_interpreter(group, monkeypatch):
    """Rank 64 in 8 groups (dequantise path), 2 and 1 groups (grouped-dot path with a scale
    word shared by quarters). 2 and 1 groups give tokens that are not 16-byte multiples,
    which check_spec_supported refuses for the GPU; the interpreter has no such limit."""
    import mla_fuzz.kernels.decode as kdecode
    import mla_fuzz.kernels.decode_split as ds
    monkeypatch.setattr(kdecode, "check_spec_supported", lambda spec: None)
    spec = ModelSpec(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_heads=3,
                     q_lora_rank=48, hidden=64, fp8_group=group)
    assert ds.fp8_grouped_dots(64, group) == (group != 8)
    case = make_case(spec, seq_lens=[40, 9], q_lens=[2, 1], s_q=2, page_size=8, kv_dtype="fp8", seed=9)
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=2)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what=f"group {group}")


def test_sched_state_is_lazy_and_reused():
    """FlashMLA's contract: a planned SchedState is reused as is — a state planned for one
    batch silently keeps that plan for another (the laziness bug class), a fresh one does not."""
    spec = ModelSpec.tiny(num_heads=2)
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=4, min_tiles_per_part=1)
    short = make_case(spec, seq_lens=[0, 40], q_lens=[0, 1], s_q=1, page_size=16, kv_dtype="bf16", seed=1)
    longer = make_case(spec, seq_lens=[60, 64], q_lens=[1, 1], s_q=1, page_size=16, kv_dtype="bf16", seed=2)
    sched = SchedState()
    assert sched.part_info is None and not sched.planned
    kernels.mla_decode(short.q, short.kv_cache, short.block_table, short.seq_lens, spec=spec, sched=sched, config=cfg)
    assert sched.planned and sched.part_info is not None
    frozen = sched.part_info.clone()
    stale_out, _ = kernels.mla_decode(longer.q, longer.kv_cache, longer.block_table, longer.seq_lens, spec=spec,
                                      sched=sched, config=cfg)
    assert torch.equal(sched.part_info, frozen), "a planned state must not re-plan"
    ref_out, ref_lse = mla_ref.mla_decode(longer.q, longer.kv_cache, longer.block_table, longer.seq_lens, spec=spec)
    assert (stale_out.float() - ref_out.float()).abs().max() > 0.05, "the stale plan must visibly miss keys"
    fresh_out, fresh_lse = kernels.mla_decode(longer.q, longer.kv_cache, longer.block_table, longer.seq_lens,
                                              spec=spec, sched=SchedState(), config=cfg)
    assert_decode_close(fresh_out, fresh_lse, ref_out, ref_lse, tol=TOL_INTERP[torch.bfloat16])
    sched.plan(longer.seq_lens, force=True)
    assert not torch.equal(sched.part_info, frozen)


def test_decode_rejects_bad_arguments():
    spec = ModelSpec.tiny(num_heads=2)
    case = make_case(spec, seq_lens=[5, 3], q_lens=[1, 1], s_q=2, page_size=4, kv_dtype="bf16")
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens)
    with pytest.raises(ValueError, match="q must be contiguous"):
        kernels.mla_decode(case.q.transpose(1, 2).contiguous().transpose(1, 2), *args[1:], spec=spec)
    with pytest.raises(ValueError, match="cache_seqlens"):
        kernels.mla_decode(*args[:3], case.seq_lens.long(), spec=spec)
    bt_t = torch.empty(case.block_table.shape[::-1], dtype=torch.int32).t()
    bt_t.copy_(case.block_table)
    with pytest.raises(ValueError, match="block_table must be contiguous"):
        kernels.mla_decode(case.q, case.kv_cache, bt_t, case.seq_lens, spec=spec)
    with pytest.raises(ValueError, match="kv_cache"):
        kernels.mla_decode(case.q, case.kv_cache[:, :, :, :10], case.block_table, case.seq_lens, spec=spec)
    with pytest.raises(ValueError, match="num_heads"):
        kernels.mla_decode(*args, spec=ModelSpec.tiny(num_heads=3))
    with pytest.raises(ValueError, match="q_lens"):
        kernels.mla_decode(*args, spec=spec, q_lens=case.q_lens[:1])
    with pytest.raises(ValueError, match="power of two"):
        kernels.mla_decode(*args, spec=ModelSpec(kv_lora_rank=48, qk_rope_head_dim=16, num_heads=2, fp8_group=16))


# --------------------------------------------------------------------------- GPU, DeepSeek size

@st.composite
def gpu_case(draw):
    heads = draw(st.sampled_from([16, 20, 128]))
    s_q = draw(st.sampled_from([1, 2, 4]))
    seq, ql = draw(lens_strategy(max_batch=6, max_len=2100, s_q=s_q, page_size=64))
    kv = draw(st.sampled_from(["bf16", "fp16", "fp8", "fp8_e4m3"]))
    seed = draw(st.integers(0, 2 ** 16))
    return heads, s_q, seq, ql, kv, seed


@pytest.mark.gpu
@settings(max_examples=24, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(gpu_case())
def test_decode_matches_reference_gpu(args):
    heads, s_q, seq, ql, kv, seed = args
    spec = ModelSpec(num_heads=heads)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=64, kv_dtype=kv, seed=seed, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, k_scale=case.k_scale)
    ref_out, ref_lse = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens, k_scale=case.k_scale)
    assert_decode_close(out, lse, ref_out, ref_lse, tol=TOL_GPU[case.q.dtype],
                        what=f"h={heads} s_q={s_q} seq={seq} ql={ql} {kv}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8_e4m3"])
def test_decode_long_split_gpu(kv):
    """One long request among short ones: the planner must split it across many parts."""
    spec = ModelSpec(num_heads=128)
    case = make_case(spec, seq_lens=[17000, 1, 0, 700], q_lens=[2, 1, 0, 2], s_q=2, page_size=64, kv_dtype=kv,
                     seed=7, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, k_scale=case.k_scale)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                             k_scale=case.k_scale)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=kv)


# the Triton kernel's FP8 load paths: one stage (TMA at 16 rows where a tile fits a page, else
# plain pointer loads), the grouped-dot twin loads (num_stages >= 2, block_m <= 32) at the shapes
# they may be tuned to (128-key tiles at 16 rows: the default off Hopper), 64-row blocks
_GPU_FP8_VARIANTS = [(16, 1, DecodeConfig(block_m=16, block_n=bn, num_warps=8, num_stages=st, num_parts=132))
                     for bn, st in ((64, 1), (64, 2), (32, 3), (128, 2))] + \
                    [(16, 2, DecodeConfig(block_m=32, block_n=64, num_warps=8, num_stages=2, num_parts=132))] + \
                    [(128, 2, DecodeConfig(block_m=64, block_n=bn, num_warps=8, num_stages=st, num_parts=33))
                     for bn, st in ((64, 2), (32, 1))]
# each variant on both FP8 paths, except the dequantise path at 128-key tiles: its [128, rank]
# dequantised tile does not fit an H100's shared memory (OutOfResources; no config picks it)
_GPU_FP8_PATH_CASES = [(h, s_q, cfg, grouped) for h, s_q, cfg in _GPU_FP8_VARIANTS for grouped in (True, False)
                       if grouped or cfg.block_n <= 64]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,cfg,grouped", _GPU_FP8_PATH_CASES)
def test_decode_fp8_load_paths_gpu(heads, s_q, cfg, grouped, monkeypatch):
    """Every FP8 load path of the Triton kernel against the reference, on both FP8 paths
    (``DecodeConfig.fp8_grouped``), with TMA tile loads where ``fp8_tma_plan`` takes them
    (compute capability >= 9, 16-row blocks, a tile inside a page) and pointer loads elsewhere.
    The cache rows past each request's length are NaN (make_case): the TMA boxes load them and
    must mask them."""
    import mla_fuzz.kernels.decode_split as ds
    seen = _spy_launches(monkeypatch, ds)
    spec = ModelSpec(num_heads=heads)
    case = make_case(spec, seq_lens=[1500, 0, 64, 333, 65], q_lens=[s_q, 0, 1, s_q, 1], s_q=s_q, page_size=64,
                     kv_dtype="fp8", seed=11, device="cuda")
    cfg = cfg.with_(fp8_grouped=grouped)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=f"{cfg}")
    expect_tma = cfg.block_m <= ds.TMA_MAX_BLOCK_M and torch.cuda.get_device_capability() >= (9, 0) \
        and 64 % cfg.block_n == 0  # a TMA box stays inside one page
    assert seen == [(expect_tma, grouped and cfg.block_m <= ds.GROUPED_MAX_BLOCK_M,
                     ds.fp8_tma_plan(case.kv_cache, rank=512, rope_dim=64, fp8_group=128, block_m=cfg.block_m,
                                     block_n=cfg.block_n, num_stages=cfg.num_stages).num_stages)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,bn,stages", [(128, 2, 128, 1), (128, 1, 128, 1), (128, 2, 64, 2), (128, 1, 32, 1),
                                                 (16, 2, 128, 1), (20, 1, 128, 1)])
def test_decode_fp8_p_via_memory_gpu(heads, s_q, bn, stages, monkeypatch):
    """P through memory at DeepSeek size in 64-row blocks of the Triton kernel (its default off
    Hopper is 128-key tiles at 1 stage): h=128, and the FP8 defaults of 17-32 rows (h=16 at
    s_q=2, h=20), whose 64-row block is half or more padding; every program of the persistent
    grid writes and reads its own scratch slot between CTA barriers, concurrently; a long request
    split over many parts, short ones, empty ones, NaN past every length."""
    import mla_fuzz.kernels.decode_split as ds
    seen = _spy_kwargs(monkeypatch, ds, "P_MEM", "GROUPED", "num_stages")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True, capability=(8, 0)).with_(block_n=bn,
                                                                                            num_stages=stages)
    assert cfg.block_m == 64 and cfg.kernel == "triton"
    case = make_case(spec, seq_lens=[9000, 1, 0, 128, 129, 2000, 64], q_lens=[s_q, 1, 0, 1, s_q, s_q, 1], s_q=s_q,
                     page_size=64, kv_dtype="fp8", seed=17, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=f"{cfg}")
    assert seen == [(True, False, stages)]


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dequant"])
@pytest.mark.parametrize("s_q,stages", [(1, 2), (1, 4), (2, 3), (2, 4)])
def test_decode_fp8_tma_stages_gpu(s_q, stages, grouped, monkeypatch):
    """The TMA path at the pipeline depths the benchmark's ``--tma`` times (h=16, the shipped
    configs at 64-key tiles -- the TMA shape at page 64 -- with num_stages 2-4, NaN past every
    request's length)."""
    import mla_fuzz.kernels.decode_split as ds
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability >= 9")
    seen = _spy_launches(monkeypatch, ds)
    spec = ModelSpec(num_heads=16)
    # 16 * s_q rows: the 16/32-row blocks whose TMA and grouped paths this tests (FP8 at 32 rows
    # defaults to the 64-row block now, which takes neither)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True).with_(block_m=16 * s_q, block_n=64,
                                                                          num_stages=stages, fp8_grouped=grouped,
                                                                          kernel="triton")
    case = make_case(spec, seq_lens=[2100, 1, 0, 64, 127, 700], q_lens=[s_q, 1, 0, 1, s_q, s_q], s_q=s_q,
                     page_size=64, kv_dtype="fp8", seed=13, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=f"{cfg}")
    tma = cfg.block_m <= ds.TMA_MAX_BLOCK_M
    assert seen == [(tma, grouped and cfg.block_m <= ds.GROUPED_MAX_BLOCK_M, stages)]


def test_fp8_grouped_path_only_for_small_row_blocks():
    """64-row blocks (h=128) keep the dequantise path: the grouped one spills there (module
    doc of kernels.decode_split); the choice follows the row block, not the spec alone."""
    import mla_fuzz.kernels.decode_split as ds
    assert ds.fp8_grouped_dots(512, 128, 16) and ds.fp8_grouped_dots(512, 128, 32)
    assert not ds.fp8_grouped_dots(512, 128, 64) and not ds.fp8_grouped_dots(512, 128, 128)
    spec = ModelSpec.tiny(num_heads=16)
    case = make_case(spec, seq_lens=[50, 3], q_lens=[4, 2], s_q=4, page_size=16, kv_dtype="fp8", seed=3)
    cfg = DecodeConfig(block_m=64, block_n=32, num_parts=3, min_tiles_per_part=1, num_stages=1)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what="fp8 block_m 64")


# (page_size, block_n, num_parts, seq_lens, q_lens): lengths 0 and 1, page and tile boundaries
# +-1, requests cut over parts and parts holding several requests, NaN past every request's
# length (make_case + e4m3_nan)
_PMEM_CASES = {
    "p16-bn16-5parts": (16, 16, 5, [37, 0, 16, 1, 17, 15, 70], [3, 0, 2, 1, 3, 2, 1]),
    "p16-bn32-3parts": (16, 32, 3, [33, 31, 64, 2, 0], [3, 1, 2, 2, 0]),
    "p64-bn16-1part": (64, 16, 1, [63, 65, 1, 32, 97], [1, 3, 1, 2, 3]),
}


@pytest.mark.parametrize("name", list(_PMEM_CASES))
def test_decode_fp8_p_via_memory_interpreter(name, monkeypatch, e4m3_nan):
    """P through memory (FP8 dequantise path in 64-row blocks; module doc of
    kernels.decode_split): P and alpha reach the PV dot through the program's scratch slot,
    the rope dot comes first. Against the reference for bf16 and fp32 q, with the launch
    checked to have taken the path (48 query rows: 16 of the block's rows are padding)."""
    import mla_fuzz.kernels.decode_split as ds
    page, bn, parts, seq, ql = _PMEM_CASES[name]
    seen = _spy_kwargs(monkeypatch, ds, "P_MEM", "GROUPED")
    spec = ModelSpec.tiny(num_heads=16)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=3, page_size=page, kv_dtype="fp8", seed=len(name))
    _zero_scales(case, spec, 0, 5, 21 if seq[0] >= 21 else seq[0])  # all-zero groups inside a request
    cfg = DecodeConfig(block_m=64, block_n=bn, num_parts=parts, min_tiles_per_part=1, num_stages=1)
    _check_bf16_and_fp32_q(case, spec, cfg, name)
    assert seen == [(True, False)] * 2


def test_fp8_p_via_memory_choice(monkeypatch):
    """Which launches hand P through memory: FP8 caches on the dequantise path in row blocks of
    at least P_MEM_MIN_BLOCK_M -- the Triton kernel's CUDA default for h=128 FP8 (off Hopper, or
    where a Hopper kernel refuses the launch) -- and the launch takes it."""
    import mla_fuzz.kernels.decode_split as ds
    assert ds.fp8_p_via_memory(True, False, 64) and ds.fp8_p_via_memory(True, False, 128)
    assert not ds.fp8_p_via_memory(True, True, 64)   # grouped path
    assert not ds.fp8_p_via_memory(False, False, 64)  # 16-bit cache: barriers would stop the pipeliner
    assert not ds.fp8_p_via_memory(True, False, 32)
    h128 = default_config(ModelSpec(num_heads=128), 2, torch.device("cuda"), fp8=True, capability=(8, 0))
    assert (h128.block_m, h128.block_n, h128.num_stages, h128.min_tiles_per_part) == (64, 128, 1, 1)
    assert not h128.fp8_grouped and h128.kernel == "triton"
    seen = _spy_kwargs(monkeypatch, ds, "P_MEM")
    spec = ModelSpec.tiny(num_heads=16)
    case = make_case(spec, seq_lens=[50, 3], q_lens=[4, 2], s_q=4, page_size=16, kv_dtype="fp8", seed=5)
    cfg = DecodeConfig(block_m=64, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=1)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what="P through memory")
    assert seen == [(True,)]


def test_fp8_path_choice_follows_config(monkeypatch):
    """``DecodeConfig.fp8_grouped`` picks the Triton kernel's FP8 path per shape: its CUDA defaults
    (off Hopper) take the grouped path at 16 rows (h=16, s_q=1) and dequantise in the 64-row block
    above (h=16 at s_q=2, whose 32 rows take the 64-row block, and h=128); on CPU the fuzzer's
    small row counts dequantise up to 16 rows and above 32, so both paths get fuzzed. The Hopper
    routes' configs name their Gluon kernel and never the grouped path. A config with
    ``fp8_grouped=False`` still matches the reference (the launcher honours it)."""
    import mla_fuzz.kernels.decode_split as ds
    cuda = torch.device("cuda")
    h16 = ModelSpec(num_heads=16)
    ampere = dict(capability=(8, 0))
    assert default_config(h16, 1, cuda, fp8=True, **ampere).fp8_grouped
    h16_sq2 = default_config(h16, 2, cuda, fp8=True, **ampere)
    assert not h16_sq2.fp8_grouped and (h16_sq2.block_m, h16_sq2.block_n, h16_sq2.num_stages) == (64, 128, 1)
    assert ds.fp8_p_via_memory(True, h16_sq2.fp8_grouped, h16_sq2.block_m)  # P through memory
    h128 = default_config(ModelSpec(num_heads=128), 2, cuda, fp8=True, **ampere)
    assert (h128.block_m, h128.block_n, h128.min_tiles_per_part) == (64, 128, 1)
    assert default_config(h16, 2, cuda, **ampere).block_m == 32  # bf16 keeps its 32-row block
    # Hopper: (heads, s_q, fp8) -> (kernel, block_m, block_n, warps, min_tiles)
    for heads, s_q, fp8, want in ((16, 1, True, ("wgmma_rs", 16, 64, 4, 4)), (16, 2, True, ("wgmma_ws64", 64, 64, 8, 2)),
                                  (16, 1, False, ("wgmma_kt", 16, 64, 4, 4)), (16, 2, False, ("wgmma_kt", 32, 64, 4, 4)),
                                  (128, 1, True, ("wgmma_ws64", 64, 64, 8, 2)), (128, 2, True, ("wgmma_ws64", 64, 64, 8, 2)),
                                  (128, 2, False, ("wgmma_pp", 64, 64, 8, 2))):
        cfg = default_config(ModelSpec(num_heads=heads), s_q, cuda, fp8=fp8, capability=(9, 0))
        assert (cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.min_tiles_per_part) == want, cfg
        assert not cfg.fp8_grouped
    # the sparse decode (its own kernel) keeps the Triton blocks
    assert default_config(ModelSpec(num_heads=128), 1, cuda, fp8=True, sparse=True).block_n == 128
    assert default_config(h16, 1, cuda, fp8=True, sparse=True).block_m == 16
    tiny = ModelSpec.tiny(num_heads=8)
    assert not default_config(tiny, 2, torch.device("cpu"), fp8=True).fp8_grouped
    assert default_config(tiny, 4, torch.device("cpu"), fp8=True).fp8_grouped
    seen = spy_launches(monkeypatch, ds, "_decode_split_kernel", "GROUPED")
    spec = ModelSpec.tiny(num_heads=4)
    case = make_case(spec, seq_lens=[33, 7], q_lens=[2, 1], s_q=2, page_size=4, kv_dtype="fp8", seed=11)
    for grouped in (False, True):
        cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=1,
                           fp8_grouped=grouped)
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, config=cfg)
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens)
        assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what=f"fp8_grouped={grouped}")
    assert seen == [(False, ), (True, )]


def test_cuda_defaults_split_h16_x2_rows_in_two_blocks_at_small_batches(monkeypatch):
    """On Hopper, h=16 x 2 query rows (FP8 and bf16) of a batch of at most
    ``SPLIT_ROWS_MAX_BATCH`` requests take two 16-row blocks of 64-key tiles with 4 warps and
    half the SMs' parts (one program a part and block), parts of two tiles; larger batches and
    ``batch=None`` keep the one-block routes, as do 16 rows, h=128, the tiny spec and non-Hopper
    devices. ``mla_decode`` passes its batch size."""
    from mla_fuzz.kernels.config import sm_count
    from mla_fuzz.kernels.routes import SPLIT_ROWS_MAX_BATCH
    cuda = torch.device("cuda")
    h16 = ModelSpec(num_heads=16)
    hopper = dict(capability=(9, 0))
    half = sm_count(cuda) // 2
    for fp8 in (True, False):
        big = default_config(h16, 2, cuda, fp8=fp8, **hopper)
        for batch in (1, 4, SPLIT_ROWS_MAX_BATCH):
            cfg = default_config(h16, 2, cuda, fp8=fp8, batch=batch, **hopper)
            assert (cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_parts, cfg.min_tiles_per_part) == \
                ("wgmma_rs" if fp8 else "wgmma_kt", 16, 64, 4, half, 2), (fp8, batch, cfg)
            assert not cfg.fp8_grouped and cfg.m_blocks(2, 16) == 2
        for batch in (SPLIT_ROWS_MAX_BATCH + 1, 32, 128):
            assert default_config(h16, 2, cuda, fp8=fp8, batch=batch, **hopper) == big, (fp8, batch)
        assert big.block_m in (32, 64)
        for heads, s_q in ((16, 1), (128, 1), (128, 2)):
            spec = ModelSpec(num_heads=heads)
            assert default_config(spec, s_q, cuda, fp8=fp8, batch=1, **hopper) == \
                default_config(spec, s_q, cuda, fp8=fp8, **hopper)
        tiny = ModelSpec.tiny(num_heads=16)
        assert default_config(tiny, 2, cuda, fp8=fp8, batch=1, **hopper) == default_config(tiny, 2, cuda, fp8=fp8,
                                                                                          **hopper)
    assert default_config(h16, 2, cuda, fp8=True, batch=1, capability=(8, 0)) == \
        default_config(h16, 2, cuda, fp8=True, capability=(8, 0))
    # mla_decode's default: the batch of its q (a CPU run: the interpreter's blocks either way)
    seen = []
    real = kernels.decode.default_config

    def spy(*args, **kw):
        seen.append(kw.get("batch"))
        return real(*args, **kw)

    monkeypatch.setattr(kernels.decode, "default_config", spy)
    spec = ModelSpec.tiny(num_heads=4)
    case = make_case(spec, seq_lens=[33, 7, 0], q_lens=[2, 1, 0], s_q=2, page_size=4, kv_dtype="bf16", seed=12)
    kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert seen == [3]


# --------------------------------------------------------------------------- FP8 TMA path

def _spy_launches(monkeypatch, ds):
    """Record ``(USE_TMA, GROUPED, num_stages)`` of every decode_split launch."""
    return _spy_kwargs(monkeypatch, ds, "USE_TMA", "GROUPED", "num_stages")


def test_interpreter_e4m3_nan_fixture(e4m3_nan):
    """The fixture above makes e4m3 NaN bytes NaN under the interpreter (and only those)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _cvt(x_ptr, y_ptr):
        o = tl.arange(0, 16)
        tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.float8e4nv, bitcast=True).to(tl.float32))

    x = torch.tensor([0x7F, 0xFF, 0x7E, 0x38, 0, 0x80] + [0x40] * 10, dtype=torch.uint8)
    y = torch.empty(16)
    _cvt[(1,)](x, y)
    ref = x.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(y[2:], ref[2:])


def test_decode_fp8_tma_falls_back_when_tiles_cross_pages(e4m3_nan):
    """page_size % block_n != 0: a tile may span two pages, so no box covers it and the
    pointer path runs, on a TMA device too (still exact against the reference)."""
    import mla_fuzz.kernels.decode_split as ds
    spec = ModelSpec.tiny(num_heads=4)
    case = make_case(spec, seq_lens=[33, 7, 0], q_lens=[2, 1, 0], s_q=2, page_size=8, kv_dtype="fp8", seed=4)
    plan = ds.fp8_tma_plan(case.kv_cache, rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim,
                           fp8_group=spec.fp8_group, block_m=16, block_n=16, num_stages=2, capability=(9, 0))
    assert not plan.use and "page_size" in plan.reason
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=2)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what="fallback")


def test_fp8_tma_plan_host_decision():
    """``fp8_tma_plan`` (host only, no GPU needed): the Triton kernel's CUDA default for the
    memory-bound 16-row FP8 shape (h=16, s_q=1, off Hopper) has 128-key tiles, which take the TMA
    path at pages of 128 but not 64 (a box must stay inside one page); its 64-key variant takes it
    at page 64 on compute capability 9+ (32 rows, s_q=2, do not: measured slower), pipelined
    (num_stages=1 is read as FP8_TMA_STAGES); not on 8.x, not on a CPU tensor, not for 64-row
    blocks, not for a misaligned or non-contiguous cache; deep pipelines are cut to the smem
    budget."""
    import mla_fuzz.kernels.decode_split as ds
    cuda = torch.device("cuda")
    spec = ModelSpec(num_heads=16)
    cache = torch.zeros(3, 64, spec.fp8_bytes_per_token, dtype=torch.uint8)
    dims = dict(rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim, fp8_group=spec.fp8_group)

    def default(s_q, heads=16):
        return default_config(ModelSpec(num_heads=heads), s_q, cuda, fp8=True, capability=(8, 0))

    def plan(cfg, kv=cache, cap=(9, 0)):
        return ds.fp8_tma_plan(kv, block_m=cfg.block_m, block_n=cfg.block_n, num_stages=cfg.num_stages,
                               capability=cap, **dims)

    assert not plan(default(2)).use  # 32 rows: the 64-row block, no TMA
    assert not plan(default(1).with_(block_m=32, block_n=64)).use  # measured slower
    # the 16-row default takes 128-key tiles (measured faster): no TMA at page 64, TMA at 128
    assert default(1).block_n == 128
    assert not plan(default(1)).use
    page128 = torch.zeros(3, 128, spec.fp8_bytes_per_token, dtype=torch.uint8)
    assert plan(default(1), kv=page128).use
    cfg = default(1).with_(block_n=64)
    p = plan(cfg)
    assert p.use and p.num_stages == (cfg.num_stages if cfg.num_stages >= 2 else ds.FP8_TMA_STAGES), p
    assert plan(cfg, cap=(10, 0)).use
    assert not plan(cfg, cap=(8, 0)).use
    assert not ds.fp8_tma_plan(cache, block_m=cfg.block_m, block_n=cfg.block_n, num_stages=2, **dims).use  # CPU
    n = 2 * 64 * spec.fp8_bytes_per_token
    misaligned = torch.zeros(n + 8, dtype=torch.uint8)[8:].view(2, 64, -1)
    assert misaligned.data_ptr() % 16 and not plan(cfg, kv=misaligned).use
    assert not plan(cfg, kv=cache.transpose(0, 1)).use
    assert not plan(cfg, kv=torch.zeros(3, 64, 1, spec.d_qk, dtype=torch.bfloat16)).use
    assert not plan(cfg.with_(block_n=128, num_stages=2), kv=cache).use  # 64 % 128
    big = default(2, heads=128)
    assert big.block_m == 64 and not plan(big).use
    assert plan(cfg.with_(num_stages=4)).num_stages == 4
    cut = plan(cfg.with_(num_stages=8))
    assert cut.use and cut.num_stages * cfg.block_n * spec.fp8_bytes_per_token <= ds.FP8_TMA_SMEM_BUDGET < \
        (cut.num_stages + 1) * cfg.block_n * spec.fp8_bytes_per_token


# --------------------------------------------------------------------------- FP8 fp16 dots

def _spy_kwargs(monkeypatch, ds, *names):
    """Record the constexprs ``names`` of every launch of the Triton kernel (a tuple per launch)."""
    return spy_launches(monkeypatch, ds, "_decode_split_kernel", *names)


# per-row changes of real query rows (what, factor, lse compared relatively): latent maxima
# ~1e5 and ~3e4 * 2.5 overflow fp16 unscaled; 40000 fits fp16 but is scaled (the threshold,
# 2**15); 1e20; a tiny row (fp16 subnormals: negligible loss, module doc); an all-zero row
# (uniform attention, qs = 1) and a rope-only row
_Q_ROW_MODS = (("latent", 1e5, True), ("row", 3e4, True), ("latent", 1e20, True), ("max", 40000.0, True),
               ("latent", 1e-6, False), ("row", 0.0, False), ("latent", 0.0, False), ("row", 1e5, True),
               ("latent", 3e4, True))


def _f16_dots_case(spec, *, seq_lens, q_lens, s_q, page_size, seed, device="cpu"):
    """An FP8 case whose bf16 query rows stress the fp16 dots' per-row power-of-two scaling:
    ``_Q_ROW_MODS`` applied to real rows spread over the batch (every 5th), and two padding
    rows +-inf instead of NaN (make_case's poison). Returns the case and the ``[B, h, s_q]``
    mask of rows whose lse is large (compared relatively by ``_assert_close_big_rows``)."""
    case = make_case(spec, seq_lens=seq_lens, q_lens=q_lens, s_q=s_q, page_size=page_size, kv_dtype="fp8",
                     seed=seed)
    rank, heads = spec.kv_lora_rank, spec.num_heads
    q = case.q.float()
    big = torch.zeros(q.shape[0], heads, s_q, dtype=torch.bool)
    real = [(b, t, h) for b in range(len(seq_lens)) for t in range(q_lens[b]) for h in range(heads)]
    pad = [(b, t, h) for b in range(len(seq_lens)) for t in range(q_lens[b], s_q) for h in range(heads)]
    assert len(real) >= 5 * len(_Q_ROW_MODS) and len(pad) >= 2
    for (b, t, h), (what, factor, is_big) in zip(real[::5], _Q_ROW_MODS):
        cols = slice(None) if what == "row" else slice(0, rank)
        if what == "max":
            q[b, t, h, cols] *= factor / q[b, t, h, cols].abs().max()
        else:
            q[b, t, h, cols] *= factor
        big[b, h, t] = is_big
    b, t, h = pad[0]
    q[b, t, h] = float("inf")
    b, t, h = pad[-1]
    q[b, t, h, :rank] = -float("inf")
    case.q = q.to(torch.bfloat16).to(device)
    if device != "cpu":
        for name in ("kv_cache", "block_table", "seq_lens", "q_lens"):
            setattr(case, name, getattr(case, name).to(device))
    return case, big


def _assert_close_big_rows(out, lse, ref_out, ref_lse, big, *, tol, what, rel_lse=1e-5):
    """``assert_decode_close`` with the lse of the ``big`` rows (|lse| ~ 1e4 and up, where
    fp32 summation order alone moves it by more than the absolute bound) compared relatively."""
    lse, ref_lse = lse.cpu(), ref_lse.cpu()
    assert torch.isfinite(lse[big]).all(), f"{what}: big rows' lse not finite"
    rel = (lse[big] - ref_lse[big]).abs() / ref_lse[big].abs()
    assert rel.max() <= rel_lse, f"{what}: big rows' lse off by {rel.max():.3g} relative"
    assert_decode_close(out, torch.where(big, ref_lse, lse), ref_out, ref_lse, tol=tol, what=what)


# (num_stages, page, block_n): the grouped path's pointer-load variants with the fp16 dots (the
# interpreter ignores num_stages; 2 -> twin loads)
_F16_PATHS = {"plain": (1, 4, 16), "twin": (2, 4, 16), "page-8": (1, 8, 16)}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf padding q x 0 codes
@pytest.mark.parametrize("path", list(_F16_PATHS))
def test_decode_fp8_fp16_dots_interpreter(path, monkeypatch, e4m3_nan):
    """The grouped path with fp16 dots (bf16 q) against the reference for each load variant:
    query rows far outside fp16's range (finite and exact only through the per-row
    power-of-two scaling), at its threshold, tiny, zero, and NaN / inf padding rows next to
    real ones; NaN cache slots past every request (made real NaN codes by ``e4m3_nan``), split
    requests, an empty request and all-zero scale groups."""
    import mla_fuzz.kernels.decode_split as ds
    stages, page, bn = _F16_PATHS[path]
    seen = _spy_kwargs(monkeypatch, ds, "GROUPED", "F16_DOTS", "USE_TMA", "TWIN")
    spec = ModelSpec.tiny(num_heads=8)  # 24 rows: two row blocks of 16, the second part-full
    case, big = _f16_dots_case(spec, seq_lens=[37, 0, 70, 1, 16, 23], q_lens=[3, 0, 2, 1, 3, 2], s_q=3,
                               page_size=page, seed=21)
    _zero_scales(case, spec, 2, 3, 19)
    cfg = DecodeConfig(block_m=16, block_n=bn, num_parts=5, min_tiles_per_part=1, num_stages=stages)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref_out, ref_lse = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens)
    _assert_close_big_rows(out, lse, ref_out, ref_lse, big, tol=TOL_INTERP[torch.bfloat16], what=path)
    assert seen == [(True, True, False, stages >= 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("s_q,stages", [(1, 1), (1, 2), (2, 1), (2, 3)])
def test_decode_fp8_fp16_dots_gpu(s_q, stages, monkeypatch):
    """The grouped FP8 path of the Triton kernel at DeepSeek size (h=16) with its fp16 dots
    through each load variant: TMA (16 rows, compute capability 9+, page 64), twin loads
    (num_stages >= 2, 32 rows); query rows far outside fp16's range, NaN past every request."""
    import mla_fuzz.kernels.decode_split as ds
    seen = _spy_kwargs(monkeypatch, ds, "GROUPED", "F16_DOTS", "USE_TMA")
    spec = ModelSpec(num_heads=16)
    # 64-key tiles: the shape TMA takes at page 64 (16 * s_q rows: the grouped path's blocks)
    cfg = DecodeConfig(block_m=16 * s_q, block_n=64, num_warps=8, num_stages=stages, fp8_grouped=True,
                       num_parts=max(1, torch.cuda.get_device_properties(0).multi_processor_count))
    case, big = _f16_dots_case(spec, seq_lens=[2100, 1, 0, 64, 127, 700], q_lens=[s_q, 1, 0, 1, s_q, s_q], s_q=s_q,
                               page_size=64, seed=17, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref_out, ref_lse = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens)
    _assert_close_big_rows(out, lse, ref_out, ref_lse, big, tol=TOL_GPU[torch.bfloat16], what=f"{cfg}",
                           rel_lse=1e-4)
    use_tma = cfg.block_m <= ds.TMA_MAX_BLOCK_M and torch.cuda.get_device_capability() >= (9, 0)
    assert seen == [(True, True, use_tma)]


def test_decode_fp8_fp16_dots_only_for_bf16_queries_on_the_grouped_path(monkeypatch):
    """The fp16 dots apply to the grouped path with bf16 queries only; fp32 and fp16 queries and
    the dequantise path never take them. All match the reference."""
    import mla_fuzz.kernels.decode_split as ds
    seen = _spy_kwargs(monkeypatch, ds, "GROUPED", "F16_DOTS")
    spec = ModelSpec.tiny(num_heads=4)
    case = make_case(spec, seq_lens=[33, 7, 0, 50], q_lens=[2, 1, 0, 2], s_q=2, page_size=4, kv_dtype="fp8",
                     seed=11)
    for grouped in (True, False):
        cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=1,
                           fp8_grouped=grouped)
        for q_dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = case.q.to(q_dtype)
            out, lse = kernels.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens, config=cfg)
            ref = mla_ref.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
            what = f"grouped={grouped} {q_dtype}"
            assert_decode_close(out, lse, *ref, tol=TOL_INTERP[q_dtype], what=what)
            assert seen.pop() == (grouped, grouped and q_dtype == torch.bfloat16), what


# --------------------------------------------------------------------------- epilogue branches

@pytest.fixture
def count_stores(monkeypatch):
    """Count the interpreter's stores and loads made inside decode_split launches (one
    entry per launch, with the launch's ``part_info`` / ``num_splits`` / ``split_offsets``)."""
    import mla_fuzz.kernels.decode_split as ds
    from triton.runtime import interpreter as interp
    cls = type(interp.interpreter_builder)
    original_store, original_load = cls.create_masked_store, cls.create_masked_load
    state = {"on": False}
    counts = []

    def store(self, ptrs, value, mask, cache_policy):
        if state["on"]:
            counts[-1]["stores"] += 1
        return original_store(self, ptrs, value, mask, cache_policy)

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        if state["on"]:
            counts[-1]["loads"] += 1
        return original_load(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(cls, "create_masked_store", store)
    monkeypatch.setattr(cls, "create_masked_load", load)
    real = ds._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                counts.append(dict(stores=0, loads=0, grid=grid, part_info=args[6].clone(), num_splits=args[7].clone(),
                                   split_offsets=args[8].clone(), cap=args[11].shape[0], kw=kw))
                state["on"] = True
                try:
                    return real[grid](*args, **kw)
                finally:
                    state["on"] = False
            return launch

    monkeypatch.setattr(ds, "_decode_split_kernel", Spy())
    return counts


def _expected_stores(launch, seq_lens) -> int:
    """Stores the kernel must make: per (program, request piece with tiles), the 4 latent
    quarters (grouped path) or one latent block, plus the lse -- direct or partial, not both;
    pieces without tiles store nothing."""
    block_n = launch["kw"]["BLOCK_N"]
    per_piece = (4 if launch["kw"]["GROUPED"] else 1) + 1
    info = launch["part_info"].tolist()
    n = 0
    for p in range(len(info) - 1):
        (b_first, t_first, j_first), (b_end, t_end, _) = info[p], info[p + 1]
        b_last = b_end if t_end > 0 else b_end - 1
        for b in range(b_first, b_last + 1):
            tiles = -(-max(int(seq_lens[b]), 0) // block_n)
            t0 = t_first if b == b_first else 0
            t1 = t_end if b == b_end else tiles
            nsplit = int(launch["num_splits"][b])
            p_row = int(launch["split_offsets"][b]) + (j_first if b == b_first else 0)
            if t1 > t0 and (nsplit == 1 or (nsplit > 1 and p_row < launch["cap"])):
                n += per_piece
    return n * launch["grid"][1]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_split_stores_only_its_branch(kv, count_stores):
    """Each request piece makes only the stores of its branch (direct for unsplit requests,
    partial for split ones) and an empty piece none: the scalar ``if`` branches that keep
    the interpreter from executing masked-off work (module doc). Results still exact."""
    spec = ModelSpec.tiny(num_heads=3)
    case = make_case(spec, seq_lens=[0, 40, 0, 9, 64, 1], q_lens=[0, 2, 0, 1, 2, 1], s_q=2, page_size=8,
                     kv_dtype=kv, seed=4)
    for parts in (1, 3, 7):
        cfg = DecodeConfig(block_m=16, block_n=16, num_parts=parts, min_tiles_per_part=1, num_stages=1)
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, config=cfg)
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens)
        assert_decode_close(out, lse, *ref, tol=TOL_INTERP[case.q.dtype], what=f"{kv} parts={parts}")
        launch = count_stores[-1]
        assert launch["kw"]["GROUPED"] == (kv == "fp8")
        expected = _expected_stores(launch, case.seq_lens)
        assert launch["stores"] == expected, (parts, launch["stores"], expected)
    assert any(int(c["num_splits"].max()) > 1 for c in count_stores), "no split request: no partial stores"


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_split_skips_empty_requests(kv, count_stores):
    """A request without keys inside a part's range costs its program one load (its length)
    and nothing else -- no q loads, no loop set-up, no stores: three empty requests between
    two real ones add exactly three loads per row block over the same batch without them."""
    spec = ModelSpec.tiny(num_heads=3)
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=1, min_tiles_per_part=1, num_stages=1)
    for seq, ql in (([0, 9, 0, 0, 33, 0], [0, 1, 0, 0, 2, 0]), ([9, 33], [1, 2])):
        case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=2, page_size=8, kv_dtype=kv, seed=6)
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, config=cfg)
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens)
        assert_decode_close(out, lse, *ref, tol=TOL_INTERP[case.q.dtype], what=f"{kv} {seq}")
    with_empty, without = count_stores
    assert with_empty["grid"] == without["grid"] and with_empty["stores"] == without["stores"]
    assert with_empty["loads"] - without["loads"] == 3 * with_empty["grid"][1], \
        (with_empty["loads"], without["loads"])


