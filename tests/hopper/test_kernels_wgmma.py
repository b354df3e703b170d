"""The route table (kernels/routes.py) and the Hopper Gluon decodes (kernels/hopper/): which
kernel a launch takes, and why, on the CPU; their results against mla_ref on the GPU (Gluon has
no interpreter, so the CPU suite checks only the choice).

A test picks a route by its row of ``routes.ROUTES`` or by naming a kernel
(``DecodeConfig.kernel``), never by switching module globals."""
from __future__ import annotations

import functools
import glob
import os
import re

import pytest
import torch

from mla_fuzz import kernels, mla_ref
from mla_fuzz.kernels import DecodeConfig, default_config, ops, routes
from mla_fuzz.kernels.config import KERNEL_NAMES
from mla_fuzz.kernels.routes import KERNELS, ROUTES, find_route, resolve, route_config
from mla_fuzz.mla_ref import ModelSpec
from kernels_cases import TOL_GPU, TOL_INTERP, assert_decode_close, make_case, spy_launches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KW = dict(rank=512, rope_dim=64, block_m=64, block_n=64, num_warps=8, fp8_group=128)
_HOPPER = (9, 0)


def _q(heads, s_q, dtype=torch.bfloat16, batch=1):
    return torch.empty(batch, s_q, heads, 576, dtype=dtype)


def _fp8(page=64, blocks=4):
    return torch.empty(blocks, page, 656, dtype=torch.uint8)


def _b16(page=64, dtype=torch.bfloat16, blocks=4, d=576):
    return torch.empty(blocks, page, 1, d, dtype=dtype)


def _resolve(q, kv, kernel, cap=_HOPPER, **kw):
    return resolve(q, kv, kernel=kernel, capability=cap, **dict(_KW, **kw))


# --------------------------------------------------------------------------- the route table

def test_route_table_is_well_formed():
    """Every row names a kernel of ``KERNELS`` whose blocks and cache kind it fits, a known
    platform, cache and decode kind, a non-empty row range, and (CUDA rows) the results json
    behind its choice, which exists in ``benchmarks/results``. Hopper rows name a Gluon kernel,
    except the per-tensor e4m3 cache's, which name the Triton kernel and say why."""
    assert tuple(KERNELS) == KERNEL_NAMES
    for r in ROUTES:
        k = KERNELS[r.kernel]
        assert r.platform in ("hopper", "cuda", "cpu") and r.cache in ("16-bit", "fp8", "fp8_e4m3", "any")
        assert r.decode in ("dense", "sparse", "any") and 1 <= r.rows[0] <= r.rows[1], r
        assert k.blocks is None or (r.block_m, r.block_n, r.num_warps) in k.blocks, r.name
        assert k.cache in ("any", r.cache), r.name
        if r.cache == "fp8_e4m3":
            assert r.kernel == "triton" and (r.platform != "hopper" or "no Gluon kernel reads it" in r.why), r.name
        else:
            assert (r.platform == "hopper") == (r.kernel != "triton"), r.name
        if r.platform != "cpu":
            cited = re.findall(r"[\w.*-]+\.json", r.why)
            assert cited, r.name
            for name in cited:
                stem = name if name.startswith(("h100", "h200")) else None
                if stem:
                    assert glob.glob(os.path.join(ROOT, "benchmarks", "results", stem)), (r.name, name)


def _facts(route, rows):
    """(spec, s_q, kwargs of default_config) that ``route`` should match at ``rows`` query rows."""
    cpu = route.platform == "cpu"
    spec = ModelSpec.tiny(num_heads=rows) if cpu else ModelSpec(num_heads=rows)
    kw = dict(fp8=route.cache == "fp8", sparse=route.decode == "sparse",
              batch=route.max_batch if route.max_batch is not None else None)
    if route.cache == "fp8_e4m3":
        kw["fp8_e4m3"] = True
    if not cpu:
        kw["capability"] = _HOPPER if route.platform == "hopper" else (8, 0)
    return spec, 1, torch.device("cpu" if cpu else "cuda"), kw


@pytest.mark.parametrize("route", ROUTES, ids=[r.name for r in ROUTES])
def test_each_route_is_the_first_match_at_both_ends_of_its_rows(route):
    """A route's facts at the first and last of its query rows (past 192: 192) find that route
    -- no earlier row shadows it -- and ``default_config`` gives its kernel, blocks and reason."""
    for rows in sorted({route.rows[0], min(route.rows[1], 192)}):
        spec, s_q, device, kw = _facts(route, rows)
        assert find_route(spec, s_q, device, **kw) is route, (rows, find_route(spec, s_q, device, **kw).name)
        cfg = default_config(spec, s_q, device, **kw)
        assert (cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.min_tiles_per_part) == \
            (route.kernel, route.block_m, route.block_n, route.num_warps, route.num_stages, route.min_tiles)
        assert cfg == route_config(route, spec, s_q, device).with_(fp8_grouped=cfg.fp8_grouped)
        assert cfg.reason.startswith(route.name) and route.why in cfg.reason
        assert cfg.fp8_grouped == (route.fp8_grouped and kw["fp8"])


def test_default_configs_on_cuda_devices():
    """Parts: one program a row block and SM (``num_parts * m_blocks = SMs``), the combine in
    16-row blocks of 128 columns; a batch-limited route only for a known batch at or below its
    limit; a Hopper route only for the shapes the Gluon kernels are written for (the tiny spec
    and FP8 groups of 64 take the Triton rows, as on an Ampere) and never for the sparse decode."""
    cuda = torch.device("cuda")
    h16 = ModelSpec(num_heads=16)
    cfg = default_config(h16, 2, cuda, fp8=True, batch=1, capability=_HOPPER)
    assert cfg.kernel == "wgmma_rs" and cfg.num_parts * cfg.m_blocks(2, 16) == 132
    assert (cfg.combine_block_m, cfg.combine_col_blocks) == (16, 4)
    assert default_config(h16, 2, cuda, fp8=True, batch=5, capability=_HOPPER).kernel == "wgmma_ws64"
    assert default_config(h16, 2, cuda, fp8=True, capability=_HOPPER).kernel == "wgmma_ws64"
    for heads in (8, 16, 32):
        for s_q in (1, 2, 4):
            for fp8 in (False, True):
                tiny = ModelSpec.tiny(num_heads=heads)
                hopper = default_config(tiny, s_q, cuda, fp8=fp8, capability=_HOPPER)
                assert hopper == default_config(tiny, s_q, cuda, fp8=fp8, capability=(8, 0))
                assert hopper.kernel == "triton"
    assert default_config(ModelSpec(num_heads=16, fp8_group=64), 1, cuda, fp8=True, capability=_HOPPER).kernel == \
        "triton"
    assert default_config(ModelSpec(num_heads=16, fp8_group=64), 1, cuda, capability=_HOPPER).kernel == "wgmma_kt"
    assert default_config(h16, 1, cuda, fp8=True, sparse=True, capability=_HOPPER).kernel == "triton"
    assert default_config(ModelSpec(num_heads=128), 1, cuda, fp8=True, capability=(10, 0)).kernel == "triton"


def test_fp8_e4m3_cache_never_takes_a_gluon_kernel():
    """The per-tensor e4m3 cache (fp8_e4m3) runs the Triton kernel on every platform and shape by
    a route of its own that says why (no Gluon kernel reads it), never a fallback; a config naming
    a Gluon kernel is refused for it by ``resolve`` with the cache kind named; ``fp8`` and
    ``fp8_e4m3`` together are refused."""
    cuda = torch.device("cuda")
    for heads in (16, 20, 128):
        for s_q in (1, 2, 4):
            for batch in (None, 1, 64):
                for cap in (_HOPPER, (8, 0), (10, 0)):
                    cfg = default_config(ModelSpec(num_heads=heads), s_q, cuda, fp8_e4m3=True, batch=batch,
                                         capability=cap)
                    assert cfg.kernel == "triton" and not cfg.fp8_grouped, (heads, s_q, cap, cfg)
                    assert "/fp8_e4m3/" in cfg.reason or "/any/" in cfg.reason, cfg.reason
                    if cap == _HOPPER:
                        assert "no Gluon kernel reads it" in cfg.reason
            sparse = default_config(ModelSpec(num_heads=heads), 1, cuda, fp8_e4m3=True, sparse=True, capability=_HOPPER)
            assert sparse.kernel == "triton"
    e4m3 = _b16(dtype=torch.float8_e4m3fn)
    for kernel in KERNEL_NAMES:
        if kernel == "triton":
            continue
        k = KERNELS[kernel]
        kw = dict(zip(("block_m", "block_n", "num_warps"), k.blocks[0]))
        name, why = _resolve(_q(16 if kw["block_m"] == 16 else 128, 1, batch=8), e4m3, kernel, **kw)
        assert name == "triton" and "fp8_e4m3 cache" in why and why.startswith(kernel), (kernel, why)
    with pytest.raises(ValueError, match="give one"):
        default_config(ModelSpec(num_heads=16), 1, cuda, fp8=True, fp8_e4m3=True, capability=_HOPPER)


def test_config_kernel_and_reason():
    """``DecodeConfig.kernel`` names a kernel of the table (checked at construction and at the
    op's entry); ``reason`` says which route chose a config, is not compared, and is dropped by
    ``with_`` (a modified config is no longer the route's)."""
    with pytest.raises(ValueError, match="kernel must be one of"):
        DecodeConfig(kernel="keys")
    cfg = default_config(ModelSpec(num_heads=128), 1, torch.device("cuda"), capability=_HOPPER)
    assert cfg.kernel == "wgmma_pp" and "hopper/16-bit/dense/33+:wgmma_pp" in cfg.reason
    assert cfg.with_(num_parts=3).reason == "" and cfg.with_(reason="mine").reason == "mine"
    assert cfg.with_() == cfg
    with pytest.raises(ValueError, match="kernel must be one of"):
        resolve(_q(16, 1), _fp8(), kernel="keys", **_KW)
    spec = ModelSpec.tiny(num_heads=2)
    case = make_case(spec, seq_lens=[5, 3], q_lens=[1, 1], s_q=1, page_size=4, kv_dtype="bf16")
    out = torch.empty(2, 1, 2, spec.kv_lora_rank, dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops.decode_split(case.q, case.kv_cache, case.block_table, case.seq_lens, torch.ones(2, 1, **i32),
                         torch.ones(1, **i32), torch.zeros(4, 3, **i32), torch.zeros(2, **i32), torch.zeros(2, **i32),
                         out, torch.empty(2, 2, 1), torch.empty(6, 2, spec.kv_lora_rank), torch.empty(6, 2),
                         spec.softmax_scale, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group, 16, 16, 4, 1,
                         True, "keys")


# --------------------------------------------------------------------------- the kernel table

def test_every_gluon_kernel_refuses_what_no_hopper_kernel_can_run():
    """The checks every Gluon kernel shares (``routes._hopper_reason``), each named: a CPU tensor,
    a device that is not Hopper, dtypes (FP8 takes bf16 queries and 128-value groups in the codes
    | scales | rope token; 16-bit takes q of the cache's dtype), the spec's shapes -- and the launch
    then takes the Triton kernel."""
    q, kv = _q(128, 2), _b16()
    fq, fkv = _q(128, 2), _fp8()
    assert _resolve(q, kv, "wgmma") == ("wgmma", "")
    assert _resolve(_q(128, 2, torch.float16), _b16(dtype=torch.float16), "wgmma") == ("wgmma", "")
    assert _resolve(fq, fkv, "wgmma_ws64") == ("wgmma_ws64", "")
    for kernel, args, kw, why in (
            ("wgmma", (q, kv), dict(cap=None), "not a CUDA tensor"),
            ("wgmma", (q, kv), dict(cap=(8, 0)), "not Hopper"),
            ("wgmma", (q, kv), dict(cap=(10, 0)), "not Hopper"),
            ("wgmma", (_q(128, 2, torch.float32), kv), {}, "q of the cache's dtype"),
            ("wgmma", (_q(128, 2, torch.float16), kv), {}, "q of the cache's dtype"),
            ("wgmma_ws64", (_q(128, 2, torch.float16), fkv), {}, "queries"),
            ("wgmma_ws64", (fq, fkv), dict(fp8_group=64), "scale group"),
            ("wgmma_ws64", (fq, fkv[..., :640]), {}, "token layout"),
            ("wgmma", (q, kv), dict(rank=256), "rank"),
            ("wgmma", (q, kv), dict(block_m=32), "block"),
            ("wgmma", (q, kv), dict(num_warps=4), "block"),
            ("wgmma", (fq, fkv), {}, "FP8 cache"),
            ("wgmma_ws64", (q, kv), {}, "16-bit cache")):
        name, reason = _resolve(*args, kernel, **kw)
        assert name == "triton" and why in reason and reason.startswith(kernel), (kernel, why, reason)


def test_ping_pong_kernel_takes_two_row_blocks_of_16_pairs():
    """The ping-pong kernel (``wgmma_pp``) takes 16-bit 64-row launches of two or more row blocks
    and 16+ (request, row block) pairs; the rest fall to the 64-row kernel (``wgmma``)."""
    for batch, heads, s_q in ((8, 128, 1), (4, 128, 2), (8, 20, 4), (8, 65, 1), (6, 33, 4), (128, 128, 2)):
        assert _resolve(_q(heads, s_q, batch=batch), _b16(), "wgmma_pp")[0] == "wgmma_pp", (batch, heads, s_q)
    for batch, heads, s_q in ((128, 64, 1), (128, 16, 2), (1, 128, 1), (1, 128, 2), (7, 128, 1), (3, 128, 2),
                              (5, 33, 4)):
        name, why = _resolve(_q(heads, s_q, batch=batch), _b16(), "wgmma_pp")
        assert name == "wgmma" and "ping-pong" in why, (batch, heads, s_q, why)
    name, why = _resolve(_q(128, 2, batch=8), _fp8(), "wgmma_pp")
    assert name == "triton" and "wgmma_pp" in why and "wgmma:" in why


def test_few_row_fp8_kernels_take_16_row_blocks_their_copies_fit():
    """FP8 16-row blocks of 64-key tiles with 4 warps: the register-operand kernel
    (``wgmma_rs``) where TMA can copy the cache -- contiguous, 16-byte aligned, 16-byte rows,
    pages that hold whole tiles or that a tile holds whole in boxes of 8-row multiples, in as
    many row blocks as the rows need; else the warp-specialised one (``wgmma_ws``), whose rows
    fit one block; else the Triton kernel."""
    kw = dict(block_m=16, block_n=64, num_warps=4)
    for heads, s_q in ((16, 1), (8, 2), (12, 1), (1, 1), (16, 2), (20, 1), (128, 1)):
        assert _resolve(_q(heads, s_q), _fp8(), "wgmma_rs", **kw) == ("wgmma_rs", ""), (heads, s_q)
    for page in (64, 128, 256, 8, 16, 32):
        assert _resolve(_q(16, 1), _fp8(page), "wgmma_rs", **kw)[0] == "wgmma_rs", page
    for cache, why in ((_fp8(4), "multiples of 8"), (_fp8(48), "neither a multiple nor a divisor"),
                       (_fp8(128)[:, :64], "contiguous"), (torch.empty(4, 64, 650, dtype=torch.uint8), "token layout")):
        name, reason = _resolve(_q(16, 1), cache, "wgmma_rs", **kw)
        assert (name, why in reason) == ("wgmma_ws" if why != "token layout" else "triton", True), (why, reason)
    flat = torch.empty(4 * 64 * 656 + 16, dtype=torch.uint8)
    name, reason = _resolve(_q(16, 1), flat[8:8 + 4 * 64 * 656].view(4, 64, 656), "wgmma_rs", **kw)
    assert name == "wgmma_ws" and "16-byte aligned" in reason
    name, reason = _resolve(_q(16, 2), _fp8(48), "wgmma_rs", **kw)  # two blocks: only the TMA kernel takes them
    assert name == "triton" and "neither a multiple" in reason and "32 query rows in a 16-row block" in reason
    assert _resolve(_q(16, 1), _fp8(), "wgmma_ws", **kw) == ("wgmma_ws", "")
    for bad in (dict(block_m=32), dict(num_warps=8), dict(block_n=32)):
        assert "block" in _resolve(_q(16, 1), _fp8(), "wgmma_rs", **dict(kw, **bad))[1], bad
    assert "queries" in _resolve(_q(16, 1, torch.float16), _fp8(), "wgmma_rs", **kw)[1]


def test_tma_kernel_takes_16_bit_blocks_of_up_to_32_rows_its_copies_fit():
    """16-bit 16- or 32-row blocks of 64-key tiles with 4 warps: the TMA keys-on-M kernel
    (``wgmma_kt``) where its boxes can copy the cache (contiguous ``[num_blocks, page, 1, d]``,
    16-byte aligned, 16-byte rows, pages that hold whole tiles or that a tile holds whole in boxes
    of 8-row multiples), in as many blocks as the rows need; else the Triton kernel."""
    kt = functools.partial(_resolve, kernel="wgmma_kt", block_m=16, block_n=64, num_warps=4)
    for page in (64, 128, 256, 8, 16, 32):
        assert kt(_q(16, 1), _b16(page)) == ("wgmma_kt", ""), page
    assert kt(_q(16, 1, torch.float16), _b16(dtype=torch.float16))[0] == "wgmma_kt"
    for s_q, block_m in ((2, 16), (2, 32), (3, 32), (8, 16)):
        assert kt(_q(16, s_q), _b16(), block_m=block_m)[0] == "wgmma_kt", (s_q, block_m)
    flat = torch.empty(4 * 64 * 576 + 16, dtype=torch.bfloat16)
    for cache, why in ((_b16(4), "multiples of 8"), (_b16(48), "neither a multiple nor a divisor"),
                       (_b16(128)[:, :64], "contiguous"), (torch.empty(4, 64, 576, dtype=torch.bfloat16), "contiguous"),
                       (flat[4:4 + 4 * 64 * 576].view(4, 64, 1, 576), "16-byte aligned"),
                       (_b16(d=572), "bytes per token"), (_fp8(), "FP8 cache")):
        name, reason = kt(_q(16, 1), cache)
        assert name == "triton" and why in reason, (why, reason)


def test_a_build_failure_sends_launches_to_the_triton_kernel(monkeypatch):
    """A Gluon that cannot build a kernel (another Triton) is reported once and then every
    launch names the failure and takes the Triton kernel."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(routes, "UNAVAILABLE", None)
    with pytest.warns(RuntimeWarning, match="did not build"):
        routes.mark_unavailable(OutOfResources(300000, 232448, "shared memory"))
    name, why = _resolve(_q(128, 2), _b16(), "wgmma_pp")
    assert name == "triton" and "failed to build" in why
    assert "OutOfResources" in routes.UNAVAILABLE
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routes.mark_unavailable(OutOfResources(1, 0, "again"))  # no second warning
    assert "shared memory" in routes.UNAVAILABLE


@pytest.mark.parametrize("kernel", [k for k in KERNEL_NAMES if k != "triton"])
def test_a_hopper_kernel_config_runs_the_triton_kernel_under_the_interpreter(kernel, monkeypatch):
    """Gluon has no interpreter: a config naming a Hopper kernel runs the Triton kernel on CPU,
    bit for bit as the same config naming it."""
    import mla_fuzz.kernels.decode_split as ds
    seen = spy_launches(monkeypatch, ds, "_decode_split_kernel", "BLOCK_M")
    spec = ModelSpec.tiny(num_heads=8)
    kv = "fp8" if KERNELS[kernel].cache == "fp8" else "bf16"
    case = make_case(spec, seq_lens=[40, 0, 9], q_lens=[2, 0, 1], s_q=2, page_size=8, kv_dtype=kv, seed=2)
    cfg = DecodeConfig(block_m=16, block_n=16, num_parts=3, min_tiles_per_part=1, num_stages=1)
    outs = [kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens,
                               config=cfg.with_(kernel=k)) for k in (kernel, "triton")]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(*outs[0], *ref, tol=TOL_INTERP[case.q.dtype], what=kernel)
    assert seen == [(16,), (16,)]


# --------------------------------------------------------------------------- GPU, DeepSeek size

def _spy_kernels(monkeypatch):
    """Count the launches of every kernel: ``{name: calls}`` (the Gluon launchers of
    ``routes.LAUNCHERS`` and the Triton kernel's)."""
    calls = {k: [] for k in KERNEL_NAMES}

    def wrap(name, real):
        def spy(*args, **kw):
            calls[name].append(kw)
            return real(*args, **kw)
        return spy

    for name, real in list(routes.LAUNCHERS.items()):
        monkeypatch.setitem(routes.LAUNCHERS, name, wrap(name, real))
    monkeypatch.setattr(routes, "launch_decode_split", wrap("triton", routes.launch_decode_split))
    return calls


def _ran(calls) -> dict:
    return {k: len(v) for k, v in calls.items() if v}


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["default", "triton"])
@pytest.mark.parametrize("heads,s_q,page,kv", [(128, 2, 64, "bf16"), (128, 1, 16, "bf16"), (128, 2, 32, "fp16"),
                                               (128, 1, 128, "bf16"), (20, 4, 64, "bf16"), (64, 1, 64, "fp16"),
                                               (128, 2, 64, "fp8"), (128, 1, 16, "fp8"), (16, 2, 64, "fp8"),
                                               (20, 4, 128, "fp8"), (16, 1, 64, "fp8"), (16, 2, 32, "bf16"),
                                               (16, 1, 64, "bf16")])
def test_decode_routes_match_reference_gpu(heads, s_q, page, kv, route, monkeypatch):
    """The default route of each shape (on a Hopper GPU its Gluon kernel: h=16 FP8 the
    register-operand few-row kernel at s_q=1, the other FP8 cases the warp-specialised 64-row
    one, 16-bit ones of more than 64 query rows and 16+ (request, block) pairs the ping-pong one,
    16-bit h=16 at s_q 1-2 the TMA keys-on-M one, the rest the plain 64-row one) and the Triton
    kernel's route (an Ampere's) at DeepSeek size, bf16, fp16 and FP8 caches: a long request split
    over many parts, lengths at and around tile and page boundaries, empty requests, NaN in every
    stale slot and padding query row; h=20 x 4 tokens leaves padding rows in the last block."""
    calls = _spy_kernels(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cap = None if route == "default" else (8, 0)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=kv == "fp8", capability=cap)
    seq = [9000, 1, 0, 63, 64, 65, 2000, 128, 129]
    ql = [0 if L == 0 else (1 if i % 3 == 1 else min(s_q, L)) for i, L in enumerate(seq)]
    case = make_case(spec, seq_lens=seq, q_lens=ql, s_q=s_q, page_size=page, kv_dtype=kv, seed=23, device="cuda")
    out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                  q_lens=case.q_lens, config=cfg)
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[case.q.dtype], what=f"h={heads} s_q={s_q} page={page} {kv}")
    want, _ = resolve(case.q, case.kv_cache, kernel=cfg.kernel, rank=512, rope_dim=64, fp8_group=128,
                      block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps)
    assert _ran(calls) == {want: 1}
    if route == "default" and _hopper():
        assert want != "triton"
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


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
@pytest.mark.parametrize("heads,s_q,page", [(16, 1, 64), (16, 1, 16), (16, 1, 128), (8, 1, 32), (8, 2, 64),
                                            (12, 1, 64), (16, 1, 8)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("kernel", ["wgmma_rs", "wgmma_ws"])
def test_decode_wgmma_ws_matches_reference_gpu(heads, s_q, page, big_q, parts, kernel, monkeypatch):
    """The two FP8 kernels of 16-row blocks of 64-key tiles against mla_ref at DeepSeek size, up
    to 16 query rows (h=12: 4 padding rows in the block; h=8 x 2 tokens with mixed query
    lengths): the register-operand one (kernels/hopper/decode_wgmma_rs.py: TMA copies of raw cache
    rows into a ring of stages, two consumer warpgroups converting the codes into wgmma's
    register operands, their halves of the scores handed over each tile; pages of 16 and 32
    keys take one box a page) and the warp-specialised one (kernels/hopper/decode_wgmma_ws.py: a
    producer partition converting 64-key tiles into two shared buffers, a consumer warpgroup's
    dots). Lengths around the 64-key tiles and the pages, a 9000-key request split over many
    parts, empty requests (which every partition must skip alike, or their hand-overs go out of
    step), NaN in every stale slot -- which TMA copies and the register-operand kernel must mask
    -- and padding query token; ``big_q``: q times 2**17 (past fp16's range, which the per-row
    power of two must undo); ``parts``: the default plan, or 3 parts of many tiles and requests
    each (the stages' phases wrap many times)."""
    calls = _spy_kernels(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True, capability=_HOPPER).with_(kernel=kernel)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (16, 64, 4), cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000], 37)
    assert _ran(calls) == {kernel if _hopper() else "triton": 1}
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


_KT_CASES = [(16, 1, 64, "bf16"), (16, 1, 16, "bf16"), (16, 1, 128, "fp16"), (8, 1, 32, "bf16"), (8, 2, 64, "bf16"),
             (12, 1, 64, "fp16"), (16, 1, 8, "bf16"), (16, 2, 64, "bf16"), (16, 2, 16, "bf16"), (20, 1, 32, "fp16")]


@pytest.mark.gpu
# big_q with bf16 caches only: q times 2**17 is past fp16's range (an fp16 q would hold infs)
@pytest.mark.parametrize("heads,s_q,page,kv,big_q", [c + (False, ) for c in _KT_CASES] +
                         [c + (True, ) for c in _KT_CASES if c[3] == "bf16"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
def test_decode_wgmma_kt_matches_reference_gpu(heads, s_q, page, kv, big_q, parts, monkeypatch):
    """The TMA keys-on-M kernel of 16-bit caches (kernels/hopper/decode_wgmma_kt.py: a one-warp
    producer copying each 64-key tile's rows in nine 64-column boxes into a ring of two stages, a
    consumer warpgroup's dots reading them, as K and transposed as K^T) against mla_ref at
    DeepSeek size, in 16-row blocks up to 16 query rows (h=12: 4 padding rows in the block; h=8 x
    2 tokens with mixed query lengths) and 32-row ones above (h=16 x 2; h=20: 12 padding rows);
    pages of 8-32 keys take one box a page. Lengths around the 64-key tiles and the pages, a
    9000-key request split over many parts, empty requests (which both partitions must skip
    alike), NaN in every stale slot -- which TMA copies and the consumer must zero before PV --
    and padding query token; ``big_q`` (bf16 only) and ``parts`` as in the test above."""
    calls = _spy_kernels(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), capability=_HOPPER)
    assert (cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps) == \
        ("wgmma_kt", (16 if heads * s_q <= 16 else 32), 64, 4), cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000],
                    43, kv=kv)
    assert _ran(calls) == {"wgmma_kt" if _hopper() else "triton": 1}
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


_ROW_BLOCK_CASES = [("fp8", 16, 2, 64), ("fp8", 16, 2, 16), ("fp8", 20, 1, 64), ("fp8", 8, 4, 32), ("fp8", 128, 1, 64),
                    ("bf16", 16, 2, 64), ("bf16", 16, 2, 8), ("fp16", 20, 1, 32), ("bf16", 8, 4, 64),
                    ("bf16", 128, 1, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv,heads,s_q,page,big_q", [c + (False, ) for c in _ROW_BLOCK_CASES] +
                         [c + (True, ) for c in _ROW_BLOCK_CASES if c[1:3] == (16, 2) and c[3] == 64])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
def test_few_row_kernels_in_several_row_blocks_match_reference_gpu(kv, heads, s_q, page, big_q, parts, monkeypatch):
    """The few-row TMA kernels (FP8: decode_wgmma_rs, 16-bit: decode_wgmma_kt) with more query
    rows than their 16-row block, one program a part and row block (grid ``(num_parts,
    m_blocks)``): h=16 x 2 in two blocks (the Hopper route at small batches, ``default_config``'s
    ``batch``), h=20 in two with 12 padding rows in the second, h=8 x 4 with mixed query lengths (a
    block holding two tokens' rows), h=128 in eight. Against mla_ref at DeepSeek size, lengths
    around tiles and pages, a 9000-key request split over many parts, empty requests, NaN in every
    stale slot and padding query token; ``big_q`` and ``parts`` as above. Which kernel ran is
    asserted."""
    fp8 = kv == "fp8"
    kernel = "wgmma_rs" if fp8 else "wgmma_kt"
    calls = _spy_kernels(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cuda = torch.device("cuda")
    m_blocks = -(-heads * s_q // 16)
    cfg = default_config(spec, s_q, cuda, fp8=fp8, batch=1, capability=_HOPPER).with_(
        block_m=16, block_n=64, num_warps=4, num_stages=1, min_tiles_per_part=2, fp8_grouped=False, kernel=kernel,
        num_parts=max(1, torch.cuda.get_device_properties(0).multi_processor_count // m_blocks))
    if (heads, s_q) == (16, 2):  # the shipped small-batch route is this config
        assert default_config(spec, s_q, cuda, fp8=fp8, batch=1, capability=_HOPPER) == cfg
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000],
                    47, kv=kv)
    assert _ran(calls) == {kernel if _hopper() else "triton": 1}
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page", [(128, 1, 64), (128, 1, 16), (128, 2, 128), (64, 1, 32), (20, 4, 64)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("staged", [False, True], ids=["direct-out", "staged-out"])
def test_decode_wgmma_ws64_matches_reference_gpu(heads, s_q, page, big_q, parts, staged, monkeypatch):
    """The warp-specialised 64-row FP8 kernel (kernels/hopper/decode_wgmma_ws64.py: a producer
    partition copying each 64-key tile into a free buffer and dequantising it there, in place,
    a scale group at a time; two consumer warpgroups' dots) against mla_ref at DeepSeek size:
    h=128 at s_q 1-2 (one and four row blocks), h=64 and h=20 x 4 tokens (16 padding rows in
    the second block, mixed query lengths) in 64-row blocks of 64-key tiles with 8 warps (up
    to 32 rows: the next test). Lengths around the tiles and pages, a 9000-key request split
    over many parts, empty requests (both partitions must skip them alike), NaN in every stale
    slot and padding query token; ``big_q`` and ``parts`` as above (3 parts: the buffers' phases
    wrap many times, the producer crosses requests). ``staged``: unsplit requests' ``out`` goes
    through q's shared buffer (``W64_STAGE_OUT_PARTS_PER_REQUEST``) and a part's last piece, when
    split, its fp32 partial through the two K buffers (``W64_STAGE_PART_PARTS_PER_REQUEST``; the
    9000-key request ends a piece in most parts), both forced here (by default each only in
    launches of few / many parts a request), or both straight from the accumulator; the launch
    says which."""
    import mla_fuzz.kernels.hopper.decode_wgmma_ws64 as dws64
    monkeypatch.setattr(dws64, "W64_STAGE_OUT_PARTS_PER_REQUEST", 10**6 if staged else 0)
    monkeypatch.setattr(dws64, "W64_STAGE_PART_PARTS_PER_REQUEST", 0 if staged else None)
    launches = spy_launches(monkeypatch, dws64, "_decode_ws64_kernel", "STAGE_OUT", "STAGE_PART")
    calls = _spy_kernels(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True, capability=_HOPPER)
    assert (cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps) == ("wgmma_ws64", 64, 64, 8)
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000], 41)
    assert _ran(calls) == {"wgmma_ws64" if _hopper() else "triton": 1}
    assert launches == ([(staged, staged)] if _hopper() else [])
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page", [(16, 2, 64), (16, 2, 16), (8, 4, 128), (20, 1, 64), (12, 2, 32),
                                            (16, 1, 64)])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
def test_decode_wgmma_ws64_few_rows_gpu(heads, s_q, page, big_q, parts, monkeypatch):
    """The warp-specialised FP8 kernel at up to 32 query rows a request, which it runs in its
    keys-on-M consumer (``decode_wgmma_ws64.W64_KEYS_ROWS``: scores ``S^T [keys, rows]``, one
    warpgroup holding every row beside an 8-warp producer), against mla_ref: h=16 x 2 (pages of
    16: each key's page through the block table; of 64: a tile's page a tile ahead), h=8 x 4
    tokens (32 rows, mixed query lengths, causal within the request), h=20 and h=12 x 2 (padding
    rows inside the 32), h=16 x 1. Requests, NaN poisoning, ``big_q`` and ``parts`` as above. The
    kernel's launch says which consumer ran, in how many warps, beside how many producer warps."""
    import mla_fuzz.kernels.hopper.decode_wgmma_ws64 as dws64
    launches = spy_launches(monkeypatch, dws64, "_decode_ws64_kernel", "KEYS", "num_warps", "PRODUCER_WARPS")
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=True, capability=_HOPPER).with_(
        block_m=64, block_n=64, num_warps=8, num_stages=1, min_tiles_per_part=2, fp8_grouped=False, kernel="wgmma_ws64")
    _check_fp8_case(spec, cfg, s_q, page, big_q, parts, [9000, 1, 0, 63, 64, 65, 127, 128, 129, 0, 257, 2000], 43)
    assert launches == ([(True, dws64.W64_KEYS_WARPS, dws64.W64_KEYS_PRODUCER_WARPS)] if _hopper() else [])
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page,kv", [(128, 1, 64, "bf16"), (128, 1, 16, "fp16"), (128, 2, 128, "bf16"),
                                               (72, 1, 32, "fp16"), (20, 4, 64, "bf16"), (128, 2, 32, "bf16")])
@pytest.mark.parametrize("big_q", [False, True], ids=["q", "big-q"])
@pytest.mark.parametrize("parts", [None, 3], ids=["default-parts", "3-parts"])
@pytest.mark.parametrize("kernel,staged", [("wgmma_pp", False), ("wgmma_pp", True), ("wgmma", False)],
                         ids=["ping-pong", "ping-pong-staged-out", "64-row"])
def test_decode_wgmma_pp_matches_reference_gpu(heads, s_q, page, kv, big_q, parts, kernel, staged, monkeypatch):
    """The ping-pong 64-row kernel (kernels/hopper/decode_wgmma_pp.py: warpgroup A on a request's
    even tiles, B on its odd ones, handing P, the running max and the row sums over) and the
    64-row kernel it falls back to (kernels/hopper/decode_wgmma.py), against mla_ref at DeepSeek
    size with bf16 and fp16 caches, in the launches the ping-pong one takes (two or more row
    blocks): h=128 at s_q 1-2 (two and four row blocks), h=72 (56 padding rows in the second
    block) and h=20 x 4 tokens (48 padding rows, mixed query lengths); pages of 16-32 keys (each
    key's row through the block table) and of 64-128 (a tile's page looked up a pair ahead).
    Lengths of 1-5 tiles and around the pages (odd counts end on A's tile alone, even ones on
    B's), a 9000-key request split over many parts (a piece may start on any tile), empty
    requests (both partitions must skip them alike), NaN in every stale slot and padding query
    token; ``big_q``: q times 2**2 and the softmax scale times 2**-2 (larger logits: more
    rescaling; bf16 / fp16 q leave no room for the few-row kernels' 2**17); ``parts``: the default
    plan, or 3 parts of many tiles and requests each (the hand-overs' phases wrap many times);
    ``staged``: unsplit requests' ``out`` through each warpgroup's own buffer
    (``PP_STAGE_OUT_PARTS_PER_REQUEST``, forced here; by default only launches of few parts a
    request) or straight from the accumulator, the launch's choice asserted."""
    import mla_fuzz.kernels.hopper.decode_wgmma_pp as dpp
    monkeypatch.setattr(dpp, "PP_STAGE_OUT_PARTS_PER_REQUEST", 10**6 if staged else 0)
    launches = spy_launches(monkeypatch, dpp, "_decode_pp_kernel", "STAGE_OUT")
    calls = _spy_kernels(monkeypatch)
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), capability=_HOPPER).with_(kernel=kernel)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 64, 8)
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
    assert _ran(calls) == {kernel if _hopper() else "triton": 1}
    assert launches == ([(staged, )] if _hopper() and kernel == "wgmma_pp" else [])
    assert routes.UNAVAILABLE is None, routes.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,heads,s_q,kv", [("wgmma", 128, 2, "bf16"), ("wgmma_pp", 128, 2, "bf16"),
                                                 ("wgmma_ws", 16, 1, "fp8"), ("wgmma_rs", 16, 1, "fp8"),
                                                 ("wgmma_ws64", 128, 1, "fp8"), ("wgmma_kt", 16, 1, "bf16")])
def test_decode_wgmma_build_failure_falls_back_gpu(kernel, heads, s_q, kv, monkeypatch):
    """A Gluon kernel failing to build (here: a resource error raised by its launch) gives a
    warning and the Triton kernel's result with the same blocks, for this launch and the next."""
    from triton.runtime.errors import OutOfResources
    import mla_fuzz.kernels.hopper.decode_wgmma as dw
    import mla_fuzz.kernels.hopper.decode_wgmma_kt as dkt
    import mla_fuzz.kernels.hopper.decode_wgmma_pp as dpp
    import mla_fuzz.kernels.hopper.decode_wgmma_rs as drs
    import mla_fuzz.kernels.hopper.decode_wgmma_ws as dws
    import mla_fuzz.kernels.hopper.decode_wgmma_ws64 as dws64
    monkeypatch.setattr(routes, "UNAVAILABLE", None)

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise OutOfResources(300000, 232448, "shared memory")
            return launch

    module, name = {"wgmma": (dw, "_decode_wgmma_kernel"), "wgmma_pp": (dpp, "_decode_pp_kernel"),
                    "wgmma_ws": (dws, "_decode_ws_kernel"), "wgmma_rs": (drs, "_decode_rs_kernel"),
                    "wgmma_ws64": (dws64, "_decode_ws64_kernel"), "wgmma_kt": (dkt, "_decode_kt_kernel")}[kernel]
    monkeypatch.setattr(module, name, Unbuildable())
    spec = ModelSpec(num_heads=heads)
    cfg = default_config(spec, s_q, torch.device("cuda"), fp8=kv == "fp8", capability=_HOPPER).with_(kernel=kernel)
    # five requests: h=128 x 2 is then 20 (request, row block) pairs, enough for the ping-pong kernel
    case = make_case(spec, seq_lens=[700, 0, 65, 129, 1], q_lens=[s_q, 0, 1, s_q, 1], s_q=s_q, page_size=64,
                     kv_dtype=kv, seed=3, device="cuda")
    ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec, q_lens=case.q_lens)
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    with pytest.warns(RuntimeWarning, match="did not build"):
        out, lse = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                      q_lens=case.q_lens, config=cfg)
    assert_decode_close(out, lse, *ref, tol=TOL_GPU[torch.bfloat16], what="fallback")
    assert "OutOfResources" in routes.UNAVAILABLE
    out2, lse2 = kernels.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                    q_lens=case.q_lens, config=cfg)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
