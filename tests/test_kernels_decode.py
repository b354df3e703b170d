"""kernels.mla_decode against mla_ref.mla_decode (CPU interpreter; DeepSeek size on GPU)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_ref
from mla_ref import ModelSpec

import kernels
from kernels import DecodeConfig, SchedState
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, lens_strategy, make_case

# small launch configs that force splits (few parts, 1 tile each minimum) or none
# (and both FP8 load paths: register prefetch on/off)
_CPU_CONFIGS = [DecodeConfig(block_m=16, block_n=16, num_parts=p, min_tiles_per_part=m, num_stages=1,
                             fp8_prefetch=pf)
                for p, m, pf in ((1, 1, True), (3, 1, False), (5, 2, True), (7, 1, False))]


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


# the FP8 load paths of the default configs (checked on an H200 before they became defaults)
_GPU_FP8_VARIANTS = [(16, 1, DecodeConfig(block_m=16, block_n=64, num_warps=8, num_stages=st, num_parts=132,
                                          fp8_prefetch=pf)) for st, pf in ((1, True), (2, False))] + \
                    [(128, 2, DecodeConfig(block_m=64, block_n=bn, num_warps=8, num_stages=st, num_parts=33,
                                           fp8_prefetch=pf)) for bn, st, pf in ((64, 2, False), (32, 1, True))]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,cfg", _GPU_FP8_VARIANTS)
def test_decode_fp8_load_paths_gpu(heads, s_q, cfg):
    """Every FP8 load path the benchmark may pick is checked against the reference."""
    spec = ModelSpec(num_heads=heads)
    case = make_case(spec, seq_lens=[1500, 0, 64, 333], q_lens=[s_q, 0, 1, s_q], s_q=s_q, page_size=64,
                     kv_dtype="fp8", seed=11, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what=str(cfg))
