"""kernels.mla_decode against mla_ref.mla_decode (CPU interpreter; DeepSeek size on GPU)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_ref
from mla_ref import ModelSpec

import kernels
from kernels import DecodeConfig, SchedState, default_config
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, lens_strategy, make_case

# small launch configs that force splits (few parts, 1 tile each minimum) or none
# (and the FP8 load variants: register prefetch, plain loads, twin loads with num_stages >= 2)
_CPU_CONFIGS = [DecodeConfig(block_m=16, block_n=16, num_parts=p, min_tiles_per_part=m, num_stages=st,
                             fp8_prefetch=pf)
                for p, m, st, pf in ((1, 1, 1, True), (3, 1, 1, False), (5, 2, 1, True), (7, 1, 1, False),
                                     (4, 1, 2, False))]


@st.composite
def cpu_case(draw):
    heads = draw(st.sampled_from([1, 3, 8, 12]))  # 3 and 12: row blocks of 16 straddle heads/tokens
    s_q = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 4, 8, 16]))
    seq, ql = draw(lens_strategy(max_batch=4, max_len=70, s_q=s_q, page_size=page))
    kv = draw(st.sampled_from(["bf16", "fp16", "fp8"]))
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
                                  q_lens=case.q_lens, config=cfg)
    ref_out, ref_lse = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens)
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


# (FP8_GROUPED_DOTS, FP8_TWIN_LOADS, num_stages, fp8_prefetch): every FP8 code path on the tiny spec
# (the interpreter ignores num_stages; 2 selects the twin loads)
_FP8_PATHS = {"grouped": (True, True, 1, False), "grouped-twin": (True, True, 2, False),
              "grouped-prefetch": (True, True, 1, True),
              "dequant": (False, True, 1, False), "dequant-prefetch": (False, True, 1, True)}


@pytest.mark.parametrize("path", list(_FP8_PATHS))
def test_decode_fp8_paths_interpreter(path, monkeypatch):
    """Each FP8 path against the reference on the edges: 3 x 12 = 36 query rows (row blocks
    of 16 straddle tokens and end part-full), requests split across parts, an empty request,
    a 1-key one, and keys whose scale words are all zero."""
    import kernels.decode_split as ds
    grouped, twin, stages, prefetch = _FP8_PATHS[path]
    monkeypatch.setattr(ds, "FP8_GROUPED_DOTS", grouped)
    monkeypatch.setattr(ds, "FP8_TWIN_LOADS", twin)
    spec = ModelSpec.tiny(num_heads=12)
    assert ds.fp8_grouped_dots(spec.kv_lora_rank, spec.fp8_group) == grouped
    case = make_case(spec, seq_lens=[37, 0, 70, 1, 16], q_lens=[3, 0, 2, 1, 3], s_q=3, page_size=4,
                     kv_dtype="fp8", seed=5)
    _zero_scales(case, spec, 0, 5, 21)
    _zero_scales(case, spec, 4, 0, 16)  # every key of request 4
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=5, min_tiles_per_part=1, num_stages=stages,
                       fp8_prefetch=prefetch)
    _check_bf16_and_fp32_q(case, spec, cfg, path)


@pytest.mark.parametrize("group", [8, 32, 64])
def test_decode_fp8_group_counts_interpreter(group, monkeypatch):
    """Rank 64 in 8 groups (dequantise path), 2 and 1 groups (grouped-dot path with a scale
    word shared by quarters). 2 and 1 groups give tokens that are not 16-byte multiples,
    which check_spec_supported refuses for the GPU; the interpreter has no such limit."""
    import kernels.decode as kdecode
    import kernels.decode_split as ds
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
    kv = draw(st.sampled_from(["bf16", "fp16", "fp8"]))
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
                                  q_lens=case.q_lens)
    ref_out, ref_lse = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                          q_lens=case.q_lens)
    assert_decode_close(out, lse, ref_out, ref_lse, tol=TOL_GPU[case.q.dtype],
                        what=f"h={heads} s_q={s_q} seq={seq} ql={ql} {kv}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_long_split_gpu(kv):
    """One long request among short ones: the planner must split it across many parts."""
    spec = ModelSpec(num_heads=128)
    case = make_case(spec, seq_lens=[17000, 1, 0, 700], q_lens=[2, 1, 0, 2], s_q=2, page_size=64, kv_dtype=kv,
                     seed=7, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=kv)


# the FP8 load paths of the default configs (checked on an H200 before they became defaults),
# plus the grouped-dot twin loads (num_stages >= 2, block_m <= 32) at the shapes it may be tuned to
_GPU_FP8_VARIANTS = [(16, 1, DecodeConfig(block_m=16, block_n=bn, num_warps=8, num_stages=st, num_parts=132,
                                          fp8_prefetch=pf)) for bn, st, pf in ((64, 1, True), (64, 2, False),
                                                                               (32, 3, False))] + \
                    [(16, 2, DecodeConfig(block_m=32, block_n=64, num_warps=8, num_stages=2, num_parts=132))] + \
                    [(128, 2, DecodeConfig(block_m=64, block_n=bn, num_warps=8, num_stages=st, num_parts=33,
                                           fp8_prefetch=pf)) for bn, st, pf in ((64, 2, False), (32, 1, True))]


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dequant"])
@pytest.mark.parametrize("heads,s_q,cfg", _GPU_FP8_VARIANTS)
def test_decode_fp8_load_paths_gpu(heads, s_q, cfg, grouped, tma, monkeypatch):
    """Every FP8 load path the benchmark may pick is checked against the reference, on both
    FP8 paths (kernels.decode_split.FP8_GROUPED_DOTS), with TMA tile loads (FP8_TMA; taken
    on compute capability >= 9 for row blocks <= 32) and without. The cache rows past each
    request's length are NaN (make_case): the TMA boxes load them and must mask them."""
    import kernels.decode_split as ds
    monkeypatch.setattr(ds, "FP8_GROUPED_DOTS", grouped)
    monkeypatch.setattr(ds, "FP8_TMA", tma)
    seen = _spy_launches(monkeypatch, ds)
    spec = ModelSpec(num_heads=heads)
    case = make_case(spec, seq_lens=[1500, 0, 64, 333, 65], q_lens=[s_q, 0, 1, s_q, 1], s_q=s_q, page_size=64,
                     kv_dtype="fp8", seed=11, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=f"{cfg} tma={tma}")
    expect_tma = tma and cfg.block_m <= ds.TMA_MAX_BLOCK_M and torch.cuda.get_device_capability() >= (9, 0)
    assert [u for u, _, _ in seen] == [expect_tma]


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dequant"])
@pytest.mark.parametrize("s_q,stages", [(1, 2), (1, 4), (2, 3), (2, 4)])
def test_decode_fp8_tma_stages_gpu(s_q, stages, grouped, monkeypatch):
    """The TMA path at the pipeline depths the benchmark's ``--tma`` times (h=16, the shipped
    configs with num_stages 2-4, page 64, NaN past every request's length)."""
    import kernels.decode_split as ds
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability >= 9")
    monkeypatch.setattr(ds, "FP8_GROUPED_DOTS", True)
    seen = _spy_launches(monkeypatch, ds)
    spec = ModelSpec(num_heads=16)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True).with_(num_stages=stages, fp8_grouped=grouped)
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
    import kernels.decode_split as ds
    assert ds.fp8_grouped_dots(512, 128, 16) and ds.fp8_grouped_dots(512, 128, 32)
    assert not ds.fp8_grouped_dots(512, 128, 64) and not ds.fp8_grouped_dots(512, 128, 128)
    spec = ModelSpec.tiny(num_heads=16)
    case = make_case(spec, seq_lens=[50, 3], q_lens=[4, 2], s_q=4, page_size=16, kv_dtype="fp8", seed=3)
    cfg = DecodeConfig(block_m=64, block_n=32, num_parts=3, min_tiles_per_part=1, num_stages=1)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what="fp8 block_m 64")


def test_fp8_path_choice_follows_config(monkeypatch):
    """``DecodeConfig.fp8_grouped`` picks the FP8 path per shape: the CUDA defaults take the
    dequantise path at 16 rows (h=16, s_q=1) and the grouped one at 32 (s_q=2), and a config
    with ``fp8_grouped=False`` still matches the reference (the launcher honours it)."""
    import kernels.decode_split as ds
    cuda = torch.device("cuda")
    assert not default_config(ModelSpec(num_heads=16), 1, cuda, fp8=True).fp8_grouped
    assert default_config(ModelSpec(num_heads=16), 2, cuda, fp8=True).fp8_grouped
    seen = []
    real = ds._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["GROUPED"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ds, "_decode_split_kernel", Spy())
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
    assert seen == [False, True]


# --------------------------------------------------------------------------- FP8 TMA path

@pytest.fixture
def e4m3_nan(monkeypatch):
    """Give the interpreter e4m3fn's NaN codes: Triton's interpreter converts bytes
    0x7F / 0xFF of ``float8e4nv`` to +-480 (seen on triton 3.9), where the GPU gives NaN, so
    a NaN-poisoned FP8 *code* in the cache is harmless on the CPU and a missing mask on the
    codes goes unseen. This wraps the interpreter's fp8 conversion to make those bytes NaN."""
    import numpy as np
    import triton.language as tl
    try:
        from triton.runtime import interpreter as interp
        cls = type(interp.interpreter_builder)
        original = cls.create_fp_to_fp
    except Exception:  # pragma: no cover - another interpreter layout
        pytest.skip("this Triton's interpreter has no create_fp_to_fp to patch")
    nan_bits = {tl.float32: (np.uint32, 0x7FC00000), tl.bfloat16: (np.uint16, 0x7FC0),
                tl.float16: (np.uint16, 0x7E00)}

    def fp_to_fp(self, src, dst_type, rounding_mode):
        res = original(self, src, dst_type, rounding_mode)
        dst = dst_type.scalar
        if src.dtype.scalar == tl.float8e4nv and dst in nan_bits:
            as_int, bits = nan_bits[dst]
            nan = (src.data & np.uint8(0x7F)) == np.uint8(0x7F)
            data = res.data.copy()
            data.view(as_int)[nan] = as_int(bits)
            res = type(res)(data, res.dtype)
        return res

    monkeypatch.setattr(cls, "create_fp_to_fp", fp_to_fp)


def _spy_launches(monkeypatch, ds):
    """Record ``(USE_TMA, GROUPED, num_stages)`` of every decode_split launch."""
    seen = []
    real = ds._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["USE_TMA"], kw["GROUPED"], kw["num_stages"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ds, "_decode_split_kernel", Spy())
    return seen


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


# (FP8_GROUPED_DOTS, page_size, block_n, seq_lens, q_lens): lengths 0, 1, page and tile
# boundaries +-1, partial last tiles; every slot past a request's length is NaN (make_case)
_TMA_CASES = {
    "grouped-p16": (True, 16, 16, [37, 0, 16, 1, 17, 15, 70], [3, 0, 2, 1, 3, 2, 1]),
    "dequant-p16": (False, 16, 16, [37, 0, 16, 1, 17, 15, 70], [3, 0, 2, 1, 3, 2, 1]),
    "grouped-p32-bn16": (True, 32, 16, [33, 31, 64, 2, 0], [3, 1, 2, 2, 0]),
    "dequant-p64-bn32": (False, 64, 32, [63, 65, 1, 32, 97], [1, 3, 1, 2, 3]),
}


@pytest.mark.parametrize("name", list(_TMA_CASES))
def test_decode_fp8_tma_interpreter(name, monkeypatch, e4m3_nan):
    """The FP8 TMA path (forced on under the interpreter) against the reference: both FP8
    paths, page sizes that are multiples of block_n, NaN in every cache row past a request's
    length (codes made NaN for real by ``e4m3_nan``), split requests, bf16 and fp32 q."""
    import kernels.decode_split as ds
    grouped, page, bn, seq, ql = _TMA_CASES[name]
    monkeypatch.setattr(ds, "FP8_GROUPED_DOTS", grouped)
    monkeypatch.setattr(ds, "FP8_TMA_ANY_DEVICE", True)
    seen = _spy_launches(monkeypatch, ds)
    spec = ModelSpec.tiny(num_heads=12)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=3, page_size=page, kv_dtype="fp8", seed=len(name))
    _zero_scales(case, spec, 0, 5, 21)  # all-zero groups inside a request
    # block_n=16: 36 rows in row blocks of 16 (straddling tokens); prefetch asked, TMA replaces it
    cfg = DecodeConfig(block_m=16, block_n=bn, num_parts=5, min_tiles_per_part=1, num_stages=1, fp8_prefetch=True)
    _check_bf16_and_fp32_q(case, spec, cfg, name)
    assert seen == [(True, grouped, ds.FP8_TMA_STAGES)] * 2


def test_decode_fp8_tma_falls_back_when_tiles_cross_pages(monkeypatch, e4m3_nan):
    """page_size % block_n != 0: a tile may span two pages, so no box covers it and the
    pointer path runs (still exact against the reference)."""
    import kernels.decode_split as ds
    monkeypatch.setattr(ds, "FP8_TMA_ANY_DEVICE", True)
    seen = _spy_launches(monkeypatch, ds)
    spec = ModelSpec.tiny(num_heads=4)
    case = make_case(spec, seq_lens=[33, 7, 0], q_lens=[2, 1, 0], s_q=2, page_size=8, kv_dtype="fp8", seed=4)
    plan = ds.fp8_tma_plan(case.kv_cache, rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim,
                           fp8_group=spec.fp8_group, block_m=16, block_n=16, num_stages=2)
    assert not plan.use and "page_size" in plan.reason
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=2)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16], what="fallback")
    assert seen == [(False, True, 2)]


def test_fp8_tma_plan_host_decision(monkeypatch):
    """``fp8_tma_plan`` (host only, no GPU needed): the shipped CUDA default config for the
    memory-bound 16-row FP8 shape (h=16, s_q=1, page 64) takes the TMA path on compute
    capability 9.x (32 rows, s_q=2, does not: measured slower), pipelined (their num_stages=1 is read as FP8_TMA_STAGES); not on 8.x, not
    with the switch off, not for 64-row blocks, not for a misaligned or non-contiguous cache;
    off on a CPU tensor unless FP8_TMA_ANY_DEVICE; deep pipelines are cut to the smem budget."""
    import kernels.decode_split as ds
    cuda = torch.device("cuda")
    spec = ModelSpec(num_heads=16)
    cache = torch.zeros(3, 64, spec.fp8_bytes_per_token, dtype=torch.uint8)
    dims = dict(rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim, fp8_group=spec.fp8_group)

    def plan(cfg, kv=cache, cap=(9, 0)):
        return ds.fp8_tma_plan(kv, block_m=cfg.block_m, block_n=cfg.block_n, num_stages=cfg.num_stages,
                               capability=cap, **dims)

    assert not plan(default_config(spec, 2, cuda, fp8=True)).use  # 32 rows: measured slower
    for s_q in (1,):
        cfg = default_config(spec, s_q, cuda, fp8=True)
        p = plan(cfg)
        assert p.use and p.num_stages == (cfg.num_stages if cfg.num_stages >= 2 else ds.FP8_TMA_STAGES), p
        assert plan(cfg, cap=(10, 0)).use
        assert not plan(cfg, cap=(8, 0)).use
        assert not ds.fp8_tma_plan(cache, block_m=cfg.block_m, block_n=cfg.block_n, num_stages=2, **dims).use
        n = 2 * 64 * spec.fp8_bytes_per_token
        misaligned = torch.zeros(n + 8, dtype=torch.uint8)[8:].view(2, 64, -1)
        assert misaligned.data_ptr() % 16 and not plan(cfg, kv=misaligned).use
        assert not plan(cfg, kv=cache.transpose(0, 1)).use
        assert not plan(cfg, kv=torch.zeros(3, 64, 1, spec.d_qk, dtype=torch.bfloat16)).use
        assert not plan(cfg.with_(block_n=128, num_stages=2), kv=cache).use  # 64 % 128
    big = default_config(ModelSpec(num_heads=128), 2, cuda, fp8=True)
    assert big.block_m == 64 and not plan(big).use
    cfg = default_config(spec, 1, cuda, fp8=True)
    assert plan(cfg.with_(num_stages=4)).num_stages == 4
    cut = plan(cfg.with_(num_stages=8))
    assert cut.use and cut.num_stages * cfg.block_n * spec.fp8_bytes_per_token <= ds.FP8_TMA_SMEM_BUDGET < \
        (cut.num_stages + 1) * cfg.block_n * spec.fp8_bytes_per_token
    monkeypatch.setattr(ds, "FP8_TMA", False)
    assert not plan(cfg).use
    monkeypatch.setattr(ds, "FP8_TMA", True)
    monkeypatch.setattr(ds, "FP8_TMA_ANY_DEVICE", True)
    assert ds.fp8_tma_plan(cache, block_m=16, block_n=64, num_stages=2, **dims).use


@st.composite
def tma_case(draw):
    heads = draw(st.sampled_from([1, 3, 8, 12]))
    s_q = draw(st.integers(1, 4))
    page, bn = draw(st.sampled_from([(16, 16), (32, 16), (32, 32)]))
    seq, ql = draw(lens_strategy(max_batch=4, max_len=70, s_q=s_q, page_size=page))
    grouped = draw(st.booleans())
    parts = draw(st.sampled_from([1, 3, 5]))
    seed = draw(st.integers(0, 2 ** 16))
    return heads, s_q, page, bn, seq, ql, grouped, parts, seed


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tma_case())
def test_decode_fp8_tma_random_interpreter(monkeypatch, e4m3_nan, args):
    """Random batches through the forced TMA path (both FP8 paths) against the reference."""
    import kernels.decode_split as ds
    heads, s_q, page, bn, seq, ql, grouped, parts, seed = args
    monkeypatch.setattr(ds, "FP8_GROUPED_DOTS", grouped)
    monkeypatch.setattr(ds, "FP8_TMA_ANY_DEVICE", True)
    spec = ModelSpec.tiny(num_heads=heads)
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype="fp8", seed=seed)
    assert ds.fp8_tma_plan(case.kv_cache, rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim,
                           fp8_group=spec.fp8_group, block_m=16, block_n=bn, num_stages=2).use
    cfg = DecodeConfig(block_m=16, block_n=bn, num_parts=parts, min_tiles_per_part=1, num_stages=2)
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_INTERP[torch.bfloat16],
                        what=f"h={heads} s_q={s_q} page={page} bn={bn} seq={seq} ql={ql} grouped={grouped}")
