"""The Hopper Gluon decode (kernels/decode_wgmma.py): when it is taken, and its results
against mla_ref on the GPU (it has no interpreter, so the CPU suite checks only the choice)."""
from __future__ import annotations

import pytest
import torch

import mla_ref
from mla_ref import ModelSpec

import kernels
import kernels.decode_split as ds
import kernels.decode_wgmma as dw
from kernels import default_config
from kernels_cases import TOL_GPU, assert_decode_close, make_case

_KW = dict(rank=512, rope_dim=64, block_m=64, block_n=64, num_warps=8)


def _tensors(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16):
    return torch.empty(1, 2, 128, 576, dtype=q_dtype), torch.empty(4, 64, 576 if kv_dtype != torch.uint8 else 656,
                                                                     dtype=kv_dtype)


def test_wgmma_plan_takes_hopper_64_row_blocks_of_64_keys_only(monkeypatch):
    assert dw.gluon is not None, "this Triton has no Gluon: the Hopper path could never be taken"
    q, kv = _tensors()
    assert dw.wgmma_plan(q, kv, capability=(9, 0), **_KW) is None
    assert dw.wgmma_plan(*_tensors(torch.float16, torch.float16), capability=(9, 0), **_KW) is None
    fq, fkv = _tensors(kv_dtype=torch.uint8)
    assert dw.wgmma_plan(fq, fkv, capability=(9, 0), **_KW) is None
    # every other fact names its reason
    assert "not a CUDA tensor" in dw.wgmma_plan(q, kv, **_KW)
    assert "not Hopper" in dw.wgmma_plan(q, kv, capability=(8, 0), **_KW)
    assert "not Hopper" in dw.wgmma_plan(q, kv, capability=(10, 0), **_KW)
    assert "q of the cache's dtype" in dw.wgmma_plan(*_tensors(torch.float32), capability=(9, 0), **_KW)
    assert "q of the cache's dtype" in dw.wgmma_plan(*_tensors(torch.float16), capability=(9, 0), **_KW)
    assert "queries" in dw.wgmma_plan(*_tensors(torch.float32, torch.uint8), capability=(9, 0), **_KW)
    assert "queries" in dw.wgmma_plan(*_tensors(torch.float16, torch.uint8), capability=(9, 0), **_KW)
    assert "scale group" in dw.wgmma_plan(fq, fkv, capability=(9, 0), fp8_group=64, **_KW)
    assert "token layout" in dw.wgmma_plan(fq, fkv[..., :640], capability=(9, 0), **_KW)
    assert "rank" in dw.wgmma_plan(q, kv, capability=(9, 0), **dict(_KW, rank=256))
    for bad in (dict(block_m=32), dict(block_n=32), dict(block_n=128), dict(num_warps=4)):
        assert "block" in dw.wgmma_plan(q, kv, capability=(9, 0), **dict(_KW, **bad))
    monkeypatch.setattr(dw, "WGMMA_DECODE", False)
    assert "WGMMA_DECODE is off" in dw.wgmma_plan(q, kv, capability=(9, 0), **_KW)


def test_a_build_failure_sends_launches_to_the_triton_kernel(monkeypatch):
    """A Gluon that cannot build the kernel (another Triton) is reported once and then every
    plan names the failure, so the Triton kernel runs."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(dw, "UNAVAILABLE", None)
    q, kv = _tensors()
    with pytest.warns(RuntimeWarning, match="did not build"):
        dw.mark_unavailable(OutOfResources(300000, 232448, "shared memory"))
    assert "failed to build" in dw.wgmma_plan(q, kv, capability=(9, 0), **_KW)
    assert "OutOfResources" in dw.UNAVAILABLE
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dw.mark_unavailable(OutOfResources(1, 0, "again"))  # no second warning
    assert "shared memory" in dw.UNAVAILABLE


def test_cuda_defaults_at_64_rows_fit_the_wgmma_kernel(monkeypatch):
    """The shipped CUDA configs of 17+ query rows (and FP8's at 16) are the shape the kernel
    is written for, on a Hopper device (whatever GPU, if any, runs the test)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for heads, s_q, kv_dtype in ((128, 1, torch.bfloat16), (128, 2, torch.bfloat16), (20, 4, torch.bfloat16),
                                 (16, 2, torch.bfloat16), (16, 1, torch.uint8), (16, 2, torch.uint8),
                                 (128, 2, torch.uint8)):
        cfg = default_config(ModelSpec(num_heads=heads), s_q, torch.device("cuda"), fp8=kv_dtype == torch.uint8)
        q, kv = _tensors(kv_dtype=kv_dtype)
        assert dw.wgmma_plan(q, kv, rank=512, rope_dim=64, block_m=cfg.block_m, block_n=cfg.block_n,
                             num_warps=cfg.num_warps, capability=(9, 0)) is None, cfg


def _spy_wgmma(monkeypatch):
    calls = []
    real = ds.launch_decode_wgmma

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(ds, "launch_decode_wgmma", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("on", [True, False], ids=["wgmma", "triton"])
@pytest.mark.parametrize("heads,s_q,page,kv", [(128, 2, 64, "bf16"), (128, 1, 16, "bf16"), (128, 2, 32, "fp16"),
                                               (128, 1, 128, "bf16"), (20, 4, 64, "bf16"), (64, 1, 64, "fp16"),
                                               (128, 2, 64, "fp8"), (128, 1, 16, "fp8"), (16, 2, 64, "fp8"),
                                               (20, 4, 128, "fp8"), (16, 1, 64, "fp8"), (16, 2, 32, "bf16")])
def test_decode_wgmma_matches_reference_gpu(heads, s_q, page, kv, on, monkeypatch):
    """Both 64-row kernels at DeepSeek size (bf16, fp16 and FP8 caches; the CUDA default
    configs): a long request split over many parts, lengths at and around tile and page
    boundaries, empty requests, NaN in every stale slot and padding query row; h=20 x 4
    tokens leaves padding rows in the last block, h=16 x 2 (FP8) half a block of them. The
    switch decides which kernel runs (on a Hopper GPU the Gluon one is the default)."""
    monkeypatch.setattr(dw, "WGMMA_DECODE", on)
    calls = _spy_wgmma(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=kv == "fp8")
    # the Triton kernel's own blocks for h=16 (off); 64 rows everywhere else
    triton_blocks = {(16, 1, "fp8"): 16, (16, 2, "bf16"): 32}
    assert cfg.block_m == (triton_blocks.get((heads, s_q, kv), 64) if not on else 64)
    seq = [9000, 1, 0, 63, 64, 65, 2000, 128, 129]
    ql = [0 if L == 0 else (1 if i % 3 == 1 else min(s_q, L)) for i, L in enumerate(seq)]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, seed=23, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[case.q.dtype], what=f"h={heads} s_q={s_q} page={page} {kv}")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert len(calls) == (1 if on and hopper else 0)
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


@pytest.mark.gpu
def test_decode_wgmma_build_failure_falls_back_gpu(monkeypatch):
    """The Gluon kernel failing to build (here: a resource error raised by its launch) gives a
    warning and the Triton kernel's result, for this launch and the next."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(dw, "UNAVAILABLE", None)

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise OutOfResources(300000, 232448, "shared memory")
            return launch

    monkeypatch.setattr(dw, "_decode_wgmma_kernel", Unbuildable())
    spec = ModelSpec(num_heads=128)
    case = make_case(spec, seq_lens=[700, 0, 65], q_lens=[2, 0, 1], s_q=2, page_size=64, kv_dtype="bf16", seed=3,
                     device="cuda")
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    with pytest.warns(RuntimeWarning, match="did not build"):
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what="fallback")
    assert "OutOfResources" in dw.UNAVAILABLE
    out2, lse2 = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                    q_lens=case.q_lens)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
