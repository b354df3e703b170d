"""The Hopper Gluon decodes (kernels/decode_wgmma.py, 64-row blocks; kernels/decode_wgmma_ws64.py,
FP8 64-row blocks, warp-specialised; kernels/decode_wgmma_keys.py, FP8 at up to 32 rows;
kernels/decode_wgmma_ws.py, FP8 at up to 16 rows, warp-specialised; kernels/decode_wgmma_rs.py, the
same launches with the codes converted in wgmma's register operands; kernels/decode_wgmma_kt.py,
16-bit caches at up to 16 rows, TMA copies): when they are taken, and
their results against mla_ref on the GPU (Gluon has no interpreter, so the CPU suite checks
only the choice)."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import ModelSpec

from mla_fuzz import kernels
import mla_fuzz.kernels.decode_split as ds
import mla_fuzz.kernels.decode_wgmma as dw
from mla_fuzz.kernels import default_config
from kernels_cases import TOL_GPU, assert_decode_close, make_case, spy_launches

_KW = dict(rank=512, rope_dim=64, block_m=64, block_n=64, num_warps=8)


def _q(heads, s_q, dtype=torch.bfloat16):
    return torch.empty(1, s_q, heads, 576, dtype=dtype)


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


def test_wgmma_plan_takes_fp8_few_row_blocks_of_128_keys(monkeypatch):
    """The keys-on-M kernel's shape: an FP8 cache with bf16 queries, every query row of a
    request in one 16- or 32-row block, 128-key tiles, 8 warps, on Hopper."""
    kw = dict(rank=512, rope_dim=64, block_n=128, num_warps=8, capability=(9, 0))
    fkv = torch.empty(4, 64, 656, dtype=torch.uint8)
    assert dw.wgmma_plan(_q(16, 1), fkv, block_m=16, **kw) is None
    assert dw.wgmma_plan(_q(16, 2), fkv, block_m=32, **kw) is None
    assert dw.wgmma_plan(_q(20, 1), fkv, block_m=32, **kw) is None
    assert dw.wgmma_plan(_q(8, 1), fkv, block_m=16, **kw) is None
    assert "32 query rows in a 16-row block" in dw.wgmma_plan(_q(16, 2), fkv, block_m=16, **kw)
    assert "FP8 caches only" in dw.wgmma_plan(_q(16, 1), torch.empty(4, 64, 576, dtype=torch.bfloat16),
                                              block_m=16, **kw)
    assert "queries" in dw.wgmma_plan(_q(16, 1, torch.float16), fkv, block_m=16, **kw)
    assert "scale group" in dw.wgmma_plan(_q(16, 1), fkv, block_m=16, fp8_group=64, **kw)
    for bad in (dict(block_m=8), dict(block_m=64), dict(num_warps=4), dict(block_n=64)):
        assert "block" in dw.wgmma_plan(_q(16, 1), fkv, **dict(dict(kw, block_m=16), **bad)), bad
    assert "not Hopper" in dw.wgmma_plan(_q(16, 1), fkv, block_m=16, **dict(kw, capability=(8, 9)))
    monkeypatch.setattr(dw, "WGMMA_KEYS", False)
    assert "WGMMA_KEYS is off" in dw.wgmma_plan(_q(16, 1), fkv, block_m=16, **kw)
    # the 64-row kernel does not depend on that switch
    assert dw.wgmma_plan(_q(16, 1), fkv, block_m=64, **dict(kw, block_n=64)) is None
    monkeypatch.setattr(dw, "WGMMA_KEYS", True)
    monkeypatch.setattr(dw, "WGMMA_DECODE", False)
    assert "WGMMA_DECODE is off" in dw.wgmma_plan(_q(16, 1), fkv, block_m=16, **kw)


def test_wgmma_plan_takes_fp8_16_row_blocks_of_64_keys_with_4_warps(monkeypatch):
    """The few-row FP8 kernels' shape: an FP8 cache with bf16 queries, 16-row blocks, 64-key
    tiles, 4 (consumer) warps, on Hopper; their switch, and the keys-on-M kernel's does not turn
    it off. More query rows than one block take as many blocks, only where the register-operand
    kernel can run them (``rs_plan``: the warp-specialised one takes one block), else the reason.
    (A 16-bit cache in this shape goes to the TMA keys-on-M kernel.)"""
    kw = dict(rank=512, rope_dim=64, block_m=16, block_n=64, num_warps=4, capability=(9, 0))
    fkv = torch.empty(4, 64, 656, dtype=torch.uint8)
    for heads, s_q in ((16, 1), (8, 2), (12, 1), (1, 1), (16, 2), (20, 1), (128, 1)):
        assert dw.wgmma_plan(_q(heads, s_q), fkv, **kw) is None, (heads, s_q)
    odd = torch.empty(4, 48, 656, dtype=torch.uint8)  # pages TMA cannot copy (rs_plan refuses)
    assert dw.wgmma_plan(_q(16, 1), odd, **kw) is None  # one block: the warp-specialised kernel
    why = dw.wgmma_plan(_q(16, 2), odd, **kw)
    assert "32 query rows in 16-row blocks" in why and "neither a multiple nor a divisor" in why, why
    # a 16-bit cache in this shape is the TMA keys-on-M kernel's (kt_plan: its own test)
    assert dw.wgmma_plan(_q(16, 1), torch.empty(4, 64, 1, 576, dtype=torch.bfloat16), **kw) is None
    assert "queries" in dw.wgmma_plan(_q(16, 1, torch.float16), fkv, **kw)
    assert "scale group" in dw.wgmma_plan(_q(16, 1), fkv, fp8_group=64, **kw)
    assert "rank" in dw.wgmma_plan(_q(16, 1), torch.empty(4, 64, 256 + 8 + 128, dtype=torch.uint8),
                                   **dict(kw, rank=256))
    for bad in (dict(block_m=32), dict(num_warps=8), dict(block_n=32)):
        assert "block" in dw.wgmma_plan(_q(16, 1), fkv, **dict(kw, **bad)), bad
    assert "not Hopper" in dw.wgmma_plan(_q(16, 1), fkv, **dict(kw, capability=(10, 0)))
    monkeypatch.setattr(dw, "WGMMA_KEYS", False)
    assert dw.wgmma_plan(_q(16, 1), fkv, **kw) is None
    monkeypatch.setattr(dw, "WGMMA_WS", False)
    assert "WGMMA_WS is off" in dw.wgmma_plan(_q(16, 1), fkv, **kw)
    monkeypatch.setattr(dw, "WGMMA_WS", True)
    monkeypatch.setattr(dw, "WGMMA_DECODE", False)
    assert "WGMMA_DECODE is off" in dw.wgmma_plan(_q(16, 1), fkv, **kw)


def test_rs_plan_takes_the_16_row_fp8_launches_its_tma_copies_fit(monkeypatch):
    """Of the launches of the warp-specialised kernel's shape, the register-operand kernel
    (kernels/decode_wgmma_rs.py) takes those whose cache its TMA boxes can copy: contiguous,
    16-byte aligned, 16-byte rows, pages that hold whole 64-key tiles or that a tile holds
    whole in boxes of 8-row multiples; its switch."""
    for page in (64, 128, 256, 8, 16, 32):
        assert dw.rs_plan(torch.empty(4, page, 656, dtype=torch.uint8), 64) is None, page
    assert "multiples of 8" in dw.rs_plan(torch.empty(4, 4, 656, dtype=torch.uint8), 64)
    assert "neither a multiple nor a divisor" in dw.rs_plan(torch.empty(4, 48, 656, dtype=torch.uint8), 64)
    assert "contiguous" in dw.rs_plan(torch.empty(4, 128, 656, dtype=torch.uint8)[:, :64], 64)
    flat = torch.empty(4 * 64 * 656 + 16, dtype=torch.uint8)
    assert "16-byte aligned" in dw.rs_plan(flat[8:8 + 4 * 64 * 656].view(4, 64, 656), 64)
    assert "bytes per token" in dw.rs_plan(torch.empty(4, 64, 650, dtype=torch.uint8), 64)
    monkeypatch.setattr(dw, "WGMMA_RS", False)
    assert "WGMMA_RS is off" in dw.rs_plan(torch.empty(4, 64, 656, dtype=torch.uint8), 64)


def test_kt_plan_takes_the_16_row_16_bit_launches_its_tma_copies_fit(monkeypatch):
    """16-bit launches of the few-row shape (16- or 32-row blocks of 64-key tiles, 4 warps) go to the TMA
    keys-on-M kernel (kernels/decode_wgmma_kt.py) when its boxes can copy the cache: contiguous
    ``[num_blocks, page, 1, d]``, 16-byte aligned, 16-byte rows, pages that hold whole 64-key
    tiles or that a tile holds whole in boxes of 8-row multiples; its switch. ``wgmma_plan``
    gives the reason when not (the Triton kernel then runs the launch), and takes more query
    rows than the block in several blocks."""
    def cache(page, d=576, dtype=torch.bfloat16, nb=4):
        return torch.empty(nb, page, 1, d, dtype=dtype)

    for page in (64, 128, 256, 8, 16, 32):
        assert dw.kt_plan(cache(page), 64) is None, page
    assert dw.kt_plan(cache(64, dtype=torch.float16), 64) is None
    assert "multiples of 8" in dw.kt_plan(cache(4), 64)
    assert "neither a multiple nor a divisor" in dw.kt_plan(cache(48), 64)
    assert "contiguous" in dw.kt_plan(cache(128)[:, :64], 64)
    assert "contiguous" in dw.kt_plan(torch.empty(4, 64, 576, dtype=torch.bfloat16), 64)
    flat = torch.empty(4 * 64 * 576 + 16, dtype=torch.bfloat16)
    assert "16-byte aligned" in dw.kt_plan(flat[4:4 + 4 * 64 * 576].view(4, 64, 1, 576), 64)
    assert "bytes per token" in dw.kt_plan(cache(64, d=572), 64)
    q = torch.empty(2, 1, 16, 576, dtype=torch.bfloat16)
    plan = functools.partial(dw.wgmma_plan, rank=512, rope_dim=64, block_m=16, block_n=64, num_warps=4,
                             capability=(9, 0))
    assert plan(q, cache(64)) is None
    assert "neither a multiple" in plan(q, cache(48))
    # more query rows than the block: as many blocks (one program a part and block)
    for s_q, block_m in ((2, 16), (2, 32), (3, 32), (8, 16)):
        assert plan(torch.empty(2, s_q, 16, 576, dtype=torch.bfloat16), cache(64), block_m=block_m) is None
    assert "block 32x64" in plan(q, torch.empty(4, 64, 656, dtype=torch.uint8), block_m=32)  # not for FP8
    monkeypatch.setattr(dw, "WGMMA_KT", False)
    assert "WGMMA_KT is off" in dw.kt_plan(cache(64), 64)
    assert "WGMMA_KT is off" in plan(q, cache(64))


def test_fp8_64_row_blocks_take_the_warp_specialised_kernel(monkeypatch):
    """Of the 64-row launches ``wgmma_plan`` admits, FP8 ones run the warp-specialised kernel
    (kernels/decode_wgmma_ws64.py) while ``WGMMA_WS64`` is on, 16-bit ones never; the plan
    itself does not depend on that switch."""
    q, kv = _tensors()
    fq, fkv = _tensors(kv_dtype=torch.uint8)
    assert dw.ws64_taken(fkv) and not dw.ws64_taken(kv)
    assert not dw.ws64_taken(torch.empty(4, 64, 576, dtype=torch.float16))
    monkeypatch.setattr(dw, "WGMMA_WS64", False)
    assert not dw.ws64_taken(fkv)
    assert dw.wgmma_plan(fq, fkv, capability=(9, 0), **_KW) is None


def test_16_bit_64_row_blocks_take_the_ping_pong_kernel(monkeypatch):
    """Of the 64-row launches ``wgmma_plan`` admits, bf16 / fp16 ones of two or more row blocks
    and at least 16 (request, row block) pairs run the ping-pong kernel
    (kernels/decode_wgmma_pp.py) while ``WGMMA_PP`` is on; one row block (up to 64 query
    rows), smaller batches and FP8 never; the plan itself does not depend on that switch."""
    kv = torch.empty(4, 64, 576, dtype=torch.bfloat16)
    half = torch.empty(4, 64, 576, dtype=torch.float16)

    def q(batch, heads, s_q, dtype=torch.bfloat16):
        return torch.empty(batch, s_q, heads, 576, dtype=dtype)

    for batch, heads, s_q in ((8, 128, 1), (4, 128, 2), (8, 20, 4), (8, 65, 1), (6, 33, 4), (128, 128, 2)):
        assert dw.pp_taken(q(batch, heads, s_q), kv), (batch, heads, s_q)
        assert dw.pp_taken(q(batch, heads, s_q, torch.float16), half), (batch, heads, s_q)
    for batch, heads, s_q in ((128, 64, 1), (128, 16, 2), (128, 32, 2), (128, 16, 4), (1, 128, 1), (1, 128, 2),
                              (7, 128, 1), (3, 128, 2), (5, 33, 4)):
        assert not dw.pp_taken(q(batch, heads, s_q), kv), (batch, heads, s_q)
    fkv = torch.empty(4, 64, 656, dtype=torch.uint8)
    assert not dw.pp_taken(q(8, 128, 2), fkv)
    assert not dw.pp_taken(q(8, 128, 2, torch.float32), torch.empty(4, 64, 576, dtype=torch.float32))
    monkeypatch.setattr(dw, "WGMMA_PP", False)
    assert not dw.pp_taken(q(8, 128, 2), kv)
    assert dw.wgmma_plan(q(8, 128, 2), kv, capability=(9, 0), **_KW) is None


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
    """The shipped CUDA configs are the shapes the Gluon kernels are written for, on a Hopper
    device (whatever GPU, if any, runs the test): FP8 at up to 16 rows the warp-specialised
    kernel's 16-row blocks of 64 keys with 4 warps (with ``WGMMA_WS`` off, the keys-on-M
    kernel's 16-row blocks of 128 keys); FP8 at 17-32 rows the 64-row blocks of the
    warp-specialised ``decode_wgmma_ws64`` (with ``WGMMA_WS64`` off, the keys-on-M kernel's
    32-row blocks); 16-bit ones at up to 32 rows the TMA kernel's 16- or 32-row blocks of 64
    keys with 4 warps; else 64 x 64 -- and with ``WGMMA_KEYS`` off, FP8 at h=16 goes back to the
    64-row blocks."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cases = ((128, 1, torch.bfloat16), (128, 2, torch.bfloat16), (20, 4, torch.bfloat16), (16, 2, torch.bfloat16),
             (16, 1, torch.bfloat16), (8, 1, torch.float16), (16, 1, torch.uint8), (16, 2, torch.uint8),
             (20, 1, torch.uint8), (128, 2, torch.uint8), (8, 2, torch.uint8))
    for keys, ws, ws64 in itertools.product((True, False), repeat=3):
        monkeypatch.setattr(dw, "WGMMA_KEYS", keys)
        monkeypatch.setattr(dw, "WGMMA_WS", ws)
        monkeypatch.setattr(dw, "WGMMA_WS64", ws64)
        for heads, s_q, kv_dtype in cases:
            fp8 = kv_dtype == torch.uint8
            rows = heads * s_q
            cfg = default_config(ModelSpec(num_heads=heads), s_q, torch.device("cuda"), fp8=fp8)
            few = keys and fp8 and (rows <= 16 or (rows <= 32 and not ws64))
            want = ((16, 64, 4) if ws and rows <= 16 else ((16 if rows <= 16 else 32), 128, 8)) if few else (64, 64, 8)
            if not fp8 and rows <= 32:
                want = ((16 if rows <= 16 else 32), 64, 4)
            assert (cfg.block_m, cfg.block_n, cfg.num_warps) == want, (keys, ws, ws64, heads, s_q, cfg)
            # (the TMA kernel takes a [num_blocks, page, 1, d] 16-bit cache, as the backend holds it)
            kv = (torch.empty(4, 64, 1, 576, dtype=kv_dtype) if not fp8 and rows <= 32 else
                  _tensors(kv_dtype=kv_dtype)[1])
            assert dw.wgmma_plan(_q(heads, s_q, kv_dtype if not fp8 else torch.bfloat16), kv, rank=512, rope_dim=64,
                                 block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
                                 capability=(9, 0)) is None, cfg


def test_cuda_defaults_keep_the_triton_blocks_for_specs_the_gluon_kernels_do_not_take(monkeypatch):
    """The Gluon kernels are written for rank 512 + rope 64 (FP8 groups of 128); for any other
    spec (the tiny one the fuzzer runs on GPUs) ``wgmma_plan`` sends every launch to the Triton
    kernel, so a Hopper device must give that spec the Triton kernel's own defaults -- the
    configs an Ampere device gets -- not Gluon-shaped blocks. DeepSeek's shapes do get other
    blocks on Hopper (h=128 FP8: 64-key tiles; h=16 FP8: 16 rows x 64 keys, 4 warps)."""
    cuda = torch.device("cuda")

    def config(spec, s_q, fp8, cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        return default_config(spec, s_q, cuda, fp8=fp8)

    for heads in (8, 16, 32):
        for s_q in (1, 2, 4):
            for fp8 in (False, True):
                spec = ModelSpec.tiny(num_heads=heads)
                hopper, ampere = config(spec, s_q, fp8, (9, 0)), config(spec, s_q, fp8, (8, 0))
                assert hopper == ampere, (heads, s_q, fp8, hopper, ampere)
    for heads, s_q in ((128, 1), (16, 1)):
        deepseek = ModelSpec(num_heads=heads)
        assert config(deepseek, s_q, True, (9, 0)) != config(deepseek, s_q, True, (8, 0)), (heads, s_q)


def _spy_wgmma(monkeypatch, name="launch_decode_wgmma"):
    calls = []
    real = getattr(ds, name)

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(ds, name, spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("on", [True, False], ids=["wgmma", "triton"])
@pytest.mark.parametrize("heads,s_q,page,kv", [(128, 2, 64, "bf16"), (128, 1, 16, "bf16"), (128, 2, 32, "fp16"),
                                               (128, 1, 128, "bf16"), (20, 4, 64, "bf16"), (64, 1, 64, "fp16"),
                                               (128, 2, 64, "fp8"), (128, 1, 16, "fp8"), (16, 2, 64, "fp8"),
                                               (20, 4, 128, "fp8"), (16, 1, 64, "fp8"), (16, 2, 32, "bf16"),
                                               (16, 1, 64, "bf16")])
def test_decode_wgmma_matches_reference_gpu(heads, s_q, page, kv, on, monkeypatch):
    """The Gluon kernels and the Triton one at DeepSeek size (bf16, fp16 and FP8 caches; the
    CUDA default configs): a long request split over many parts, lengths at and around tile
    and page boundaries, empty requests, NaN in every stale slot and padding query row; h=20
    x 4 tokens leaves padding rows in the last block. The switch decides which kernel runs
    (on a Hopper GPU the Gluon ones are the default: h=16 FP8 the warp-specialised few-row
    kernel at s_q=1, the other FP8 cases the warp-specialised 64-row one, 16-bit ones of more
    than 64 query rows the ping-pong 64-row one, 16-bit h=16 at s_q 1-2 the TMA keys-on-M one, the
    rest the plain 64-row one)."""
    monkeypatch.setattr(dw, "WGMMA_DECODE", on)
    calls = _spy_wgmma(monkeypatch)
    keys_calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_keys")
    ws_calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_ws")
    rs_calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_rs")
    ws64_calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_ws64")
    pp_calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_pp")
    kt_calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_kt")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=kv == "fp8")
    few = kv == "fp8" and heads * s_q <= 16
    # off: the Triton kernel's own blocks for h=16, 64 rows elsewhere; on: 16 rows at h=16 x 1
    # (FP8 and 16-bit), 32 at 16-bit h=16 x 2, else 64
    triton_blocks = {(16, 1, "fp8"): 16, (16, 2, "bf16"): 32, (16, 1, "bf16"): 16}
    few16 = kv != "fp8" and heads * s_q <= 32
    gluon_block = 16 if few or (few16 and heads * s_q <= 16) else 32 if few16 else 64
    assert cfg.block_m == (triton_blocks.get((heads, s_q, kv), 64) if not on else gluon_block)
    seq = [9000, 1, 0, 63, 64, 65, 2000, 128, 129]
    ql = [0 if L == 0 else (1 if i % 3 == 1 else min(s_q, L)) for i, L in enumerate(seq)]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, seed=23, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[case.q.dtype], what=f"h={heads} s_q={s_q} page={page} {kv}")
    hopper = torch.cuda.get_device_capability()[0] == 9
    if few:
        want = (0, 0, 0, 1, 0, 0, 0) if dw.rs_plan(case.kv_cache, cfg.block_n) is None else (0, 0, 1, 0, 0, 0, 0)
    else:
        # (9 requests: every 16-bit case of two or more row blocks has 16+ pairs)
        want = (0, 0, 0, 0, 1, 0, 0) if kv == "fp8" else ((0, 0, 0, 0, 0, 1, 0) if heads * s_q > 64 else
                                                          (0, 0, 0, 0, 0, 0, 1) if few16 else (1, 0, 0, 0, 0, 0, 0))
    got = (len(calls), len(keys_calls), len(ws_calls), len(rs_calls), len(ws64_calls), len(pp_calls), len(kt_calls))
    assert got == (want if on and hopper else (0, 0, 0, 0, 0, 0, 0))
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


def _check_fp8_case(spec, cfg, s_q, page, big_q, parts, seq, seed, kv="fp8"):
    """One case of the Gluon kernels' tests against mla_ref (an FP8 cache, or ``kv``'s):
    requests of ``seq`` keys (every third with one query token, empty ones with none), NaN in
    every stale slot and padding token; ``big_q``: q times 2**17 and the softmax scale times
    2**-17 (the expected result is the unscaled one: powers of two are exact); ``parts``: that
    many parts instead of ``cfg``'s."""
    if parts:
        cfg = cfg.with_(num_parts=parts)
    ql = [0 if L == 0 else (1 if i % 3 == 1 else min(s_q, L)) for i, L in enumerate(seq)]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, seed=seed,
                     device="cuda")
    big = 2.0 ** 17 if big_q else 1.0
    q, scale = case.q * big, spec.softmax_scale / big
    out, lse = kernels.mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                                  softmax_scale=scale, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                             q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[q.dtype],
                        what=f"h={spec.num_heads} s_q={s_q} page={page} big={big_q}")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page", [(16, 1, 64), (16, 1, 16), (16, 1, 128), (8, 1, 32), (16, 2, 64),
                                            (16, 2, 128), (20, 1, 32), (8, 4, 64)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
def test_decode_wgmma_keys_matches_reference_gpu(heads, s_q, page, big_q, parts, monkeypatch):
    """The keys-on-M FP8 kernel (kernels/decode_wgmma_keys.py) against mla_ref at DeepSeek
    size, both its paths: up to 16 query rows the grouped one (fp16 codes, scales on the dot
    results, q scaled per row by a power of two), 17-32 rows the dequantising one (h=20: 12
    padding rows in the 32-row block). Lengths around its 128-key tiles and the pages, a
    9000-key request split over many parts, empty requests, NaN in every stale slot and
    padding query token. ``big_q``: q times 2**17 (past fp16's range, which the grouped path
    must undo with its per-row power of two) and the softmax scale times 2**-17, so the
    logits, and the expected result, are those of the unscaled q (powers of two: exact).
    ``parts``: the default plan (132 parts: at most a tile or two each here), or 3 parts of
    many tiles and several requests each (the online softmax's rescaling across tiles). With
    both warp-specialised kernels off, so that up to 32 rows take this one (the CUDA defaults
    otherwise give it none)."""
    monkeypatch.setattr(dw, "WGMMA_WS", False)
    monkeypatch.setattr(dw, "WGMMA_WS64", False)
    calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_keys")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True)
    hopper = torch.cuda.get_device_capability()[0] == 9
    if hopper:
        assert (cfg.block_m, cfg.block_n) == ((16 if heads * s_q <= 16 else 32), 128), cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 257, 2000], 31)
    assert len(calls) == (1 if hopper else 0)
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page", [(16, 1, 64), (16, 1, 16), (16, 1, 128), (8, 1, 32), (8, 2, 64),
                                            (12, 1, 64), (16, 1, 8)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("rs", [True, False], ids=["register-operand", "warp-specialised"])
def test_decode_wgmma_ws_matches_reference_gpu(heads, s_q, page, big_q, parts, rs, monkeypatch):
    """The two FP8 kernels of 16-row blocks of 64-key tiles against mla_ref at DeepSeek size, up
    to 16 query rows (h=12: 4 padding rows in the block; h=8 x 2 tokens with mixed query
    lengths): the register-operand one (kernels/decode_wgmma_rs.py: TMA copies of raw cache
    rows into a ring of stages, two consumer warpgroups converting the codes into wgmma's
    register operands, their halves of the scores handed over each tile; pages of 16 and 32
    keys take one box a page) and, with ``WGMMA_RS`` off, the warp-specialised one
    (kernels/decode_wgmma_ws.py: a producer partition converting 64-key tiles into two shared
    buffers, a consumer warpgroup's dots). Lengths around the 64-key tiles and the pages, a
    9000-key request split over many parts, empty requests (which every partition must skip
    alike, or their hand-overs go out of step), NaN in every stale slot -- which TMA copies
    and the register-operand kernel must mask -- and padding query token; ``big_q`` and
    ``parts`` as in the keys-on-M test (3 parts: each partition crosses many requests and
    tiles, the stages' phases wrap many times)."""
    monkeypatch.setattr(dw, "WGMMA_RS", rs)
    calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_rs" if rs else "launch_decode_wgmma_ws")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True)
    hopper = torch.cuda.get_device_capability()[0] == 9
    if hopper:
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (16, 64, 4), cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000],
                        37)
    assert len(calls) == (1 if hopper else 0)
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


_KT_CASES = [(16, 1, 64, "bf16"), (16, 1, 16, "bf16"), (16, 1, 128, "fp16"), (8, 1, 32, "bf16"), (8, 2, 64, "bf16"),
             (12, 1, 64, "fp16"), (16, 1, 8, "bf16"), (16, 2, 64, "bf16"), (16, 2, 16, "bf16"), (20, 1, 32, "fp16")]


@pytest.mark.gpu
# big_q with bf16 caches only: q times 2**17 is past fp16's range (an fp16 q would hold infs)
@pytest.mark.parametrize("heads,s_q,page,kv,big_q", [c + (False, ) for c in _KT_CASES] +
                         [c + (True, ) for c in _KT_CASES if c[3] == "bf16"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
def test_decode_wgmma_kt_matches_reference_gpu(heads, s_q, page, kv, big_q, parts, monkeypatch):
    """The TMA keys-on-M kernel of 16-bit caches (kernels/decode_wgmma_kt.py: a one-warp producer
    copying each 64-key tile's rows in nine 64-column boxes into a ring of two stages, a
    consumer warpgroup's dots reading them, as K and transposed as K^T) against mla_ref at
    DeepSeek size, in 16-row blocks up to 16 query rows (h=12: 4 padding rows in the block; h=8 x
    2 tokens with mixed query lengths) and 32-row ones above (h=16 x 2; h=20: 12 padding rows);
    pages of 8-32 keys take one box a page. Lengths around the 64-key
    tiles and the pages, a 9000-key request split over many parts, empty requests (which both
    partitions must skip alike), NaN in every stale slot -- which TMA copies and the consumer
    must zero before PV -- and padding query token; ``big_q`` (bf16 only) and ``parts`` as in the
    keys-on-M test (3 parts: the stages' phases wrap many times, the producer crosses requests)."""
    calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_kt")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"))
    hopper = torch.cuda.get_device_capability()[0] == 9
    if hopper:
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == ((16 if heads * s_q <= 16 else 32), 64, 4), cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000],
                    43, kv=kv)
    assert len(calls) == (1 if hopper else 0)
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


_ROW_BLOCK_CASES = [("fp8", 16, 2, 64), ("fp8", 16, 2, 16), ("fp8", 20, 1, 64), ("fp8", 8, 4, 32), ("fp8", 128, 1, 64),
                    ("bf16", 16, 2, 64), ("bf16", 16, 2, 8), ("fp16", 20, 1, 32), ("bf16", 8, 4, 64),
                    ("bf16", 128, 1, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv,heads,s_q,page,big_q", [c + (False, ) for c in _ROW_BLOCK_CASES] +
                         [c + (True, ) for c in _ROW_BLOCK_CASES if c[1:3] == (16, 2) and c[3] == 64])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
def test_few_row_kernels_in_several_row_blocks_match_reference_gpu(kv, heads, s_q, page, big_q, parts, monkeypatch):
    """The few-row TMA kernels (FP8: kernels/decode_wgmma_rs.py, 16-bit: kernels/decode_wgmma_kt.py)
    with more query rows than their 16-row block, one program a part and row block (grid
    ``(num_parts, m_blocks)``): h=16 x 2 in two blocks (the CUDA default at small batches,
    ``default_config``'s ``batch``), h=20 in two with 12 padding rows in the second, h=8 x 4 with
    mixed query lengths (a block holding two tokens' rows), h=128 in eight. Against mla_ref at
    DeepSeek size, lengths around tiles and pages, a 9000-key request split over many parts,
    empty requests, NaN in every stale slot and padding query token; ``big_q`` and ``parts`` as
    in the keys-on-M test. Which kernel ran is asserted."""
    fp8 = kv == "fp8"
    calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_rs" if fp8 else "launch_decode_wgmma_kt")
    spec = ModelSpec(num_heads=heads)
    cuda = torch.device("cuda")
    m_blocks = -(-heads * s_q // 16)
    cfg = default_config(spec, s_q, cuda, fp8=fp8, batch=1).with_(
        block_m=16, block_n=64, num_warps=4, num_stages=1, min_tiles_per_part=2, fp8_grouped=False,
        num_parts=max(1, torch.cuda.get_device_properties(0).multi_processor_count // m_blocks))
    hopper = torch.cuda.get_device_capability()[0] == 9
    if hopper and (heads, s_q) == (16, 2):  # the shipped small-batch default is this config
        assert default_config(spec, s_q, cuda, fp8=fp8, batch=1) == cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000],
                    47, kv=kv)
    assert len(calls) == (1 if hopper else 0)
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page", [(128, 1, 64), (128, 1, 16), (128, 2, 128), (64, 1, 32), (20, 4, 64)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("staged", [False, True], ids=["direct-out", "staged-out"])
def test_decode_wgmma_ws64_matches_reference_gpu(heads, s_q, page, big_q, parts, staged, monkeypatch):
    """The warp-specialised 64-row FP8 kernel (kernels/decode_wgmma_ws64.py: a producer
    partition copying each 64-key tile into a free buffer and dequantising it there, in place,
    a scale group at a time; two consumer warpgroups' dots) against mla_ref at DeepSeek size:
    h=128 at s_q 1-2 (one and four row blocks), h=64 and h=20 x 4 tokens (16 padding rows in
    the second block, mixed query lengths) in 64-row blocks of 64-key tiles with 8 warps (up
    to 32 rows: the next test). Lengths around the tiles and pages, a 9000-key request split
    over many parts, empty requests (both partitions must skip them alike), NaN in every stale
    slot and padding query token; ``big_q`` and ``parts`` as in the keys-on-M test (3 parts:
    the buffers' phases wrap many times, the producer crosses requests). ``staged``: unsplit
    requests' ``out`` goes through q's shared buffer (``W64_STAGE_OUT_PARTS_PER_REQUEST``) and a
    part's last piece, when split, its fp32 partial through the two K buffers
    (``W64_STAGE_PART_PARTS_PER_REQUEST``; the 9000-key request ends a piece in most parts), both
    forced here (by default each only in launches of few / many parts a request), or both
    straight from the accumulator; the launch says which."""
    import mla_fuzz.kernels.decode_wgmma_ws64 as dws64
    monkeypatch.setattr(dws64, "W64_STAGE_OUT_PARTS_PER_REQUEST", 10**6 if staged else 0)
    monkeypatch.setattr(dws64, "W64_STAGE_PART_PARTS_PER_REQUEST", 0 if staged else None)
    launches = spy_launches(monkeypatch, dws64, "_decode_ws64_kernel", "STAGE_OUT", "STAGE_PART")
    calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_ws64")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True).with_(block_m=64, block_n=64, num_warps=8,
                                                                          fp8_grouped=False)
    hopper = torch.cuda.get_device_capability()[0] == 9
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000], 41)
    assert len(calls) == (1 if hopper else 0)
    assert launches == ([(staged, staged)] if hopper else [])
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page", [(16, 2, 64), (16, 2, 16), (8, 4, 128), (20, 1, 64), (12, 2, 32),
                                            (16, 1, 64)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("consumer", ["keys-1wg", "keys-2wg", "64-row"])
def test_decode_wgmma_ws64_few_rows_gpu(heads, s_q, page, big_q, parts, consumer, monkeypatch):
    """The warp-specialised FP8 kernel at up to 32 query rows a request, with each consumer:
    by default the keys-on-M one (``decode_wgmma_ws64.W64_KEYS_ROWS``: scores ``S^T [keys,
    rows]``) in one warpgroup holding every row (``W64_KEYS_WARPS`` 4, beside an 8-warp
    producer) or in two of half the rows each (8, beside a 4-warp one), and with that switch at 0 the 64-row one (the rows padded to 64), against
    mla_ref: h=16 x 2 (pages of 16: each key's page through the block table; of 64: a tile's
    page a tile ahead), h=8 x 4 tokens (32 rows, mixed query lengths, causal within the
    request), h=20 and h=12 x 2 (padding rows inside the 32), h=16 x 1. Requests, NaN
    poisoning, ``big_q`` and ``parts`` as in the test above. The kernel's launch says which
    consumer ran, in how many warps, beside how many producer warps."""
    import mla_fuzz.kernels.decode_wgmma_ws64 as dws64
    keys = consumer != "64-row"
    if consumer == "keys-1wg":
        assert dws64.W64_KEYS_WARPS == 4  # the shipped consumer
    monkeypatch.setattr(dws64, "W64_KEYS_ROWS", 32 if keys else 0)
    monkeypatch.setattr(dws64, "W64_KEYS_WARPS", 8 if consumer == "keys-2wg" else 4)
    launches = spy_launches(monkeypatch, dws64, "_decode_ws64_kernel", "KEYS", "num_warps", "PRODUCER_WARPS")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True).with_(block_m=64, block_n=64, num_warps=8,
                                                                          fp8_grouped=False)
    hopper = torch.cuda.get_device_capability()[0] == 9
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000], 43)
    warps = {"keys-1wg": 4, "keys-2wg": 8, "64-row": 8}[consumer]
    producer = {"keys-1wg": 8, "keys-2wg": 4, "64-row": 4}[consumer]
    assert launches == ([(keys, warps, producer)] if hopper else [])
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page,kv", [(128, 1, 64, "bf16"), (128, 1, 16, "fp16"), (128, 2, 128, "bf16"),
                                               (72, 1, 32, "fp16"), (20, 4, 64, "bf16"), (128, 2, 32, "bf16")])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("pp,staged", [(True, False), (True, True), (False, False)],
                         ids=["ping-pong", "ping-pong-staged-out", "64-row"])
def test_decode_wgmma_pp_matches_reference_gpu(heads, s_q, page, kv, big_q, parts, pp, staged, monkeypatch):
    """The ping-pong 64-row kernel (kernels/decode_wgmma_pp.py: warpgroup A on a request's even
    tiles, B on its odd ones, handing P, the running max and the row sums over) and, by its
    switch, the 64-row kernel it replaces, against mla_ref at DeepSeek size with bf16 and fp16
    caches, in the launches it takes (two or more row blocks): h=128 at s_q 1-2 (two and four
    row blocks), h=72 (56 padding rows in the second block) and h=20 x 4 tokens (48 padding
    rows, mixed query lengths); pages of 16-32 keys (each key's row through the block table)
    and of 64-128 (a tile's page looked up a pair ahead). Lengths of 1-5 tiles and around the
    pages (odd counts end on A's tile alone, even ones on B's), a
    9000-key request split over many parts (a piece may start on any tile), empty requests
    (both partitions must skip them alike), NaN in every stale slot and padding query token;
    ``big_q``: q times 2**2 and the softmax scale times 2**-2 (larger logits: more rescaling;
    bf16 / fp16 q leave no room for the few-row kernels' 2**17); ``parts``: the default plan,
    or 3 parts of many tiles and requests each (the hand-overs' phases wrap many times);
    ``staged``: unsplit requests' ``out`` through each warpgroup's own buffer
    (``PP_STAGE_OUT_PARTS_PER_REQUEST``, forced here; by default only launches of few parts a
    request) or straight from the accumulator, the launch's choice asserted."""
    import mla_fuzz.kernels.decode_wgmma_pp as dpp
    monkeypatch.setattr(dw, "WGMMA_PP", pp)
    monkeypatch.setattr(dpp, "PP_STAGE_OUT_PARTS_PER_REQUEST", 10**6 if staged else 0)
    launches = spy_launches(monkeypatch, dpp, "_decode_pp_kernel", "STAGE_OUT")
    calls = _spy_wgmma(monkeypatch, "launch_decode_wgmma_pp")
    plain = _spy_wgmma(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=False).with_(block_m=64, block_n=64, num_warps=8)
    if parts:
        cfg = cfg.with_(num_parts=parts)
    seq = [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 320, 2000]
    ql = [0 if L == 0 else (1 if i % 3 == 1 else min(s_q, L)) for i, L in enumerate(seq)]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, seed=43, device="cuda")
    big = 4.0 if big_q else 1.0
    out, lse = kernels.mla_decode(case.q * big, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, softmax_scale=spec.softmax_scale / big, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[case.q.dtype],
                        what=f"h={heads} s_q={s_q} page={page} {kv} big={big_q} parts={parts}")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert (len(calls), len(plain)) == (((1, 0) if pp else (0, 1)) if hopper else (0, 0))
    assert launches == ([(staged, )] if hopper and pp else [])
    assert dw.UNAVAILABLE is None, dw.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,heads,s_q,kv", [("_decode_wgmma_kernel", 128, 2, "bf16"),
                                                 ("_decode_pp_kernel", 128, 2, "bf16"),
                                                 ("_decode_keys_kernel", 16, 2, "fp8"),
                                                 ("_decode_ws_kernel", 16, 1, "fp8"),
                                                 ("_decode_rs_kernel", 16, 1, "fp8"),
                                                 ("_decode_ws64_kernel", 128, 1, "fp8"),
                                                 ("_decode_kt_kernel", 16, 1, "bf16")],
                         ids=["64-row", "pp", "keys", "ws", "rs", "ws64", "kt"])
def test_decode_wgmma_build_failure_falls_back_gpu(kernel, heads, s_q, kv, monkeypatch):
    """A Gluon kernel failing to build (here: a resource error raised by its launch) gives a
    warning and the Triton kernel's result, for this launch and the next (the ping-pong
    64-row kernel at h=128 bf16, and the plain one with the ping-pong one off; the keys-on-M
    one at h=16 FP8 s_q=2 with the warp-specialised 64-row one off, the register-operand one at
    h=16 FP8 s_q=1 and the warp-specialised few-row one there with it off, the warp-specialised
    64-row one at h=128 FP8, the TMA one at h=16 bf16 s_q=1: the CUDA defaults that reach each)."""
    from triton.runtime.errors import OutOfResources
    import mla_fuzz.kernels.decode_wgmma_keys as dk
    import mla_fuzz.kernels.decode_wgmma_ws as dws
    import mla_fuzz.kernels.decode_wgmma_ws64 as dws64
    import mla_fuzz.kernels.decode_wgmma_pp as dpp
    import mla_fuzz.kernels.decode_wgmma_rs as drs
    import mla_fuzz.kernels.decode_wgmma_kt as dkt
    monkeypatch.setattr(dw, "UNAVAILABLE", None)
    monkeypatch.setattr(dw, "WGMMA_RS", kernel == "_decode_rs_kernel")
    # the 64-row kernel runs 16-bit caches with the ping-pong one switched off; the keys-on-M
    # one takes h=16 FP8 s_q=2 with the warp-specialised 64-row one off
    monkeypatch.setattr(dw, "WGMMA_PP", kernel == "_decode_pp_kernel")
    monkeypatch.setattr(dw, "WGMMA_WS64", kernel != "_decode_keys_kernel")
    # (and the few-row FP8 kernels off, whose two 16-row blocks take h=16 x 2 at small batches)
    monkeypatch.setattr(dw, "WGMMA_WS", kernel != "_decode_keys_kernel")

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise OutOfResources(300000, 232448, "shared memory")
            return launch

    module = {"_decode_wgmma_kernel": dw, "_decode_keys_kernel": dk, "_decode_ws_kernel": dws,
              "_decode_ws64_kernel": dws64, "_decode_pp_kernel": dpp, "_decode_rs_kernel": drs,
              "_decode_kt_kernel": dkt}[kernel]
    monkeypatch.setattr(module, kernel, Unbuildable())
    spec = ModelSpec(num_heads=heads)
    # five requests: h=128 x 2 is then 20 (request, row block) pairs, enough for the ping-pong kernel
    case = make_case(spec, seq_lens=[700, 0, 65, 129, 1], q_lens=[s_q, 0, 1, s_q, 1], s_q=s_q, page_size=64,
                     kv_dtype=kv, seed=3, device="cuda")
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    with pytest.warns(RuntimeWarning, match="did not build"):
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what="fallback")
    assert "OutOfResources" in dw.UNAVAILABLE
    out2, lse2 = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                    q_lens=case.q_lens)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
