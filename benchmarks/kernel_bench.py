"""Triton MLA decode vs the machine's own rooflines (GPU only).

Measures, in the same run, the device-to-device copy bandwidth (bytes read + written) and
the bf16 matmul rate (8192^3, random data) -- each the best of ``RATE_TRIALS`` medians, all
trials recorded (``rate_trials``) -- then times ``TritonMLABackend.forward``
(planner + split-KV decode + combine) captured in a CUDA graph, for

    h_q in {16, 128} x s_q in {1, 2} x B in {1, 8, 32, 128} x L in {1k, 4k, 16k} x {bf16, fp8}

(DeepSeek-V3 dims: rank 512 + rope 64). Per case: median replay time after a clean L2
flush (``replay_timing``: a 256 MB read before every replay; ``triton.testing.do_bench``'s
flush writes 256 MB and leaves up to 50 MB of dirty lines whose write-back lands in the timed
region, so its median is recorded beside it as ``time_us_do_bench``), effective TB/s (KV bytes
+ q + out) and TFLOP/s (``2 * s_q * h * L * (576 + 512)`` per request), their ratios to the
measured ceilings, and time over the roofline bound ``max(bytes / copy_bw, flops /
matmul_rate)``. Beside them, ``read_ref_us``: torch's ``sum`` over the same KV bytes, timed the
same way (``x_read_ref`` = time / that): how far the case is from a plain read of its data;
and ``read_floor_us``, a Triton read kernel's time for those bytes (``replay_timing``'s
floor: faster than torch's sum up to ~600 MB), with ``x_read_floor`` and
``read_floor_bw_ratio``.

``--sweep`` first times a few launch configs on representative cases and uses the best per
(row class, kv dtype) for the grid. Writes JSON (``--out``) and prints a table.

``--sparse`` runs the sparse top-k case set instead (DeepSeek-V3.2 decode: h=128, s_q=2,
topk=2048, bf16 and FP8, B in {1, 8, 32, 128}, context 8k/32k): each query token attends to
its own 2048 selected slots, handed to the backend ragged (flat + indptr) and copied into
its persistent buffers by ``build``; bytes = every row's selected tokens (+ q, out, indices),
FLOPs ``2 * B * s_q * h * topk * (576 + 512)``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mla_fuzz.mla_ref import DecodeBatch, ModelSpec  # noqa: E402

from mla_fuzz.kernels import DecodeConfig, TritonMLABackend, default_config, ops  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_timing import L2Flush, ReadReference, median_replay_ms  # noqa: E402

PAGE = 64
BYTES_PER_TOKEN = {"bf16": 2 * 576, "fp8": 656}


#: each ceiling is measured this many times (medians of do_bench) and the best is used: on one
#: H100 two back-to-back runs measured the bf16 matmul at 693 and 752 TFLOP/s
#: (results/h100-2026-11-26-kernel-5-single-trial*.json), and a low ceiling flatters every
#: ratio to it; the trials are recorded in the json
RATE_TRIALS = 5
#: the measured rates of this process, per ceiling: every trial (filled by the measure_* calls)
RATE_LOG: dict = {}
#: what the json's times are
TIMING_NOTE = ("CUDA-graph replay of TritonMLABackend.forward: time_us the median of 60 replays each after a "
               "256 MB read (a clean L2 flush, replay_timing.py); time_us_do_bench the triton.testing.do_bench median "
               "(a 256 MB zero_ before each run, leaving dirty lines)")
#: the process's L2 flush (``replay_timing.L2Flush``), made on first use (it takes 256 MB)
_FLUSH = []


def l2_flush() -> L2Flush:
    """This process's ``L2Flush`` (one 256 MB buffer, allocated on the first call)."""
    if not _FLUSH:
        _FLUSH.append(L2Flush())
    return _FLUSH[0]


def _best_of(name: str, trial, trials: int) -> float:
    """Run ``trial()`` (one rate) ``trials`` times; log them under ``name``; return the max."""
    rates = [trial() for _ in range(max(1, trials))]
    RATE_LOG[name] = rates
    return max(rates)


def measure_copy_tbps(trials: int = RATE_TRIALS) -> float:
    """Device-to-device copy bandwidth, bytes read + written, TB/s: best of ``trials``
    medians of a 1 GiB ``copy_``, each run after the clean L2 flush the cases get."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    flush = l2_flush()

    def trial():
        t = median_replay_ms(lambda: dst.copy_(src), flush.clean, warmup=25, reps=200)
        return 2 * n / (t * 1e-3) / 1e12

    return _best_of("copy_TBps", trial, trials)


def measure_matmul_tflops(trials: int = RATE_TRIALS) -> float:
    """bf16 matmul rate, TFLOP/s: best of ``trials`` medians of an 8192^3 ``a @ b`` (random
    data), after a second of matmuls to bring the clocks up."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        a @ b
    torch.cuda.synchronize()

    def trial():
        t = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=300, return_mode="median")
        return 2 * n ** 3 / (t * 1e-3) / 1e12

    return _best_of("matmul_bf16_TFLOPs", trial, trials)


class CachePool:
    """One big random cache per kv dtype; each case takes random distinct pages of it."""

    def __init__(self, spec: ModelSpec, max_tokens: int):
        self.spec = spec
        self.num_blocks = max_tokens // PAGE + 1
        self.caches = {}
        self.max_tokens = max_tokens

    def get(self, kv: str) -> torch.Tensor:
        if kv not in self.caches:
            spec = self.spec
            if kv == "fp8":
                cache = torch.zeros(self.num_blocks, PAGE, spec.fp8_bytes_per_token, dtype=torch.uint8, device="cuda")
            else:
                cache = torch.zeros(self.num_blocks, PAGE, 1, spec.d_qk, dtype=torch.bfloat16, device="cuda")
            n = self.num_blocks * PAGE
            chunk = 1 << 18
            for s in range(0, n, chunk):
                T = min(chunk, n - s)
                lat = torch.randn(T, spec.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
                rope = torch.randn(T, spec.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
                slots = torch.arange(s, s + T, device="cuda", dtype=torch.int64)
                ops.write_kv_cache(cache, lat, rope, slots, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group)
            self.caches = {kv: cache}  # keep one at a time: memory
        return self.caches[kv]


def run_case(spec, pool, h, s_q, B, L, kv, config, gen):
    """``(ms, io_bytes, flops)`` of one dense case (``measure_case``'s first three)."""
    m = measure_case(spec, pool, h, s_q, B, L, kv, config, gen)
    return m["ms"], m["io_bytes"], m["flops"]


def build_case(pool, h, s_q, B, L, kv, config, gen):
    """A dense case's backend, built: B requests of L cached tokens each (L a multiple of
    ``PAGE``) on random distinct pages of ``pool``'s ``kv`` cache (``gen`` picks them), h heads,
    s_q query tokens each, ``config`` its ``DecodeConfig``. Returns ``(backend, metadata,
    cache)``."""
    spec_h = ModelSpec(num_heads=h)
    cache = pool.get(kv)
    pages = L // PAGE
    perm = torch.randperm(pool.num_blocks - 1, generator=gen)[:B * pages] + 1
    block_table = perm.view(B, pages).to(torch.int32)
    seq = torch.full((B,), L, dtype=torch.int32)
    ql = torch.full((B,), s_q, dtype=torch.int32)
    slots = torch.full((B, s_q), -1, dtype=torch.int64)
    batch = DecodeBatch(seq_lens=seq, q_lens=ql, block_table=block_table, slot_mapping=slots, page_size=PAGE,
                        next_n=s_q, pad_to=B, kv_dtype=kv)
    be = TritonMLABackend(spec_h, device="cuda", max_batch=B, capture_sizes=[B], next_n_max=s_q,
                          max_blocks_per_seq=pages, page_size=PAGE, config=config)
    return be, be.build(batch), cache


def measure_case(spec, pool, h, s_q, B, L, kv, config, gen) -> dict:
    """One dense case: B requests of L cached tokens (random distinct pages of ``pool``'s
    cache), h heads, s_q query tokens each. Returns ``ms`` (clean-flush replay median),
    ``io_bytes`` (KV + q + out), ``flops``, ``kv_bytes`` and ``time_us_do_bench``."""
    be, md, cache = build_case(pool, h, s_q, B, L, kv, config, gen)
    _, _, t_ms, t_db = _time_graph_replay(be, md, cache, spec, B, s_q, h)
    io_bytes, flops, kv_bytes = case_cost(spec, h, s_q, B, L, kv)
    return dict(ms=t_ms, io_bytes=io_bytes, flops=flops, kv_bytes=kv_bytes, time_us_do_bench=t_db * 1e3)


def case_cost(spec, h, s_q, B, L, kv) -> tuple:
    """``(io_bytes, flops, kv_bytes)`` of a dense case (``measure_case``): the cache's bytes of B
    requests of L tokens plus the bf16 q ``[B, s_q, h, d_qk]`` and out ``[B, s_q, h, rank]``, and
    the two dots' flops."""
    kv_bytes = B * L * BYTES_PER_TOKEN[kv]
    io_bytes = kv_bytes + B * s_q * h * (spec.d_qk + spec.kv_lora_rank) * 2
    flops = 2.0 * B * s_q * h * L * (spec.d_qk + spec.kv_lora_rank)
    return io_bytes, flops, kv_bytes


def roofline_ms(io_bytes: float, flops: float, copy_tbps: float, mm_tflops: float) -> float:
    """The case's lower bound on this machine: ``max(bytes / copy_bw, flops / matmul_rate)``, ms."""
    return max(io_bytes / (copy_tbps * 1e12), flops / (mm_tflops * 1e12)) * 1e3


def case_record(fields: dict, t_ms: float, io_bytes: float, flops: float, copy_tbps: float,
                mm_tflops: float) -> dict:
    """One result row: ``fields`` (the case) plus time, effective TB/s and TFLOP/s, the
    roofline bound ``max(bytes / copy_bw, flops / matmul_rate)`` and the ratios to them."""
    roof_ms = roofline_ms(io_bytes, flops, copy_tbps, mm_tflops)
    r = dict(fields, time_us=t_ms * 1e3, TBps=io_bytes / (t_ms * 1e-3) / 1e12,
             TFLOPs=flops / (t_ms * 1e-3) / 1e12, roofline_us=roof_ms * 1e3)
    r["bw_ratio"] = r["TBps"] / copy_tbps
    r["flop_ratio"] = r["TFLOPs"] / mm_tflops
    r["x_roofline"] = r["time_us"] / r["roofline_us"]
    return r


def _time_graph_replay(be, md, cache, spec, B, s_q, h):
    """Median time (ms) of a CUDA-graph replay of ``be.forward`` on random bf16 queries after
    a clean L2 flush, and do_bench's median (its dirty flush) of the same graph; returns the q
    and out buffers too (their sizes enter the byte count): ``(q, out, ms, do_bench_ms)``."""
    q = torch.randn(B, s_q, h, spec.d_qk, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(B, s_q, h, spec.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
    be.forward(q, cache, md, out=out)  # compile + warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.forward(q, cache, md, out=out)
    t_ms = median_replay_ms(graph.replay, l2_flush().clean)
    t_db = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return q, out, t_ms, t_db


def run_sparse_case(spec, pool, h, s_q, B, L, kv, topk, gen):
    """One sparse case: random distinct positions per (request, token) among L cached keys."""
    spec_h = ModelSpec(num_heads=h)
    cache = pool.get(kv)
    pages = L // PAGE
    perm = torch.randperm(pool.num_blocks - 1, generator=gen)[:B * pages] + 1
    block_table = perm.view(B, pages).to(torch.int32)
    flat = []
    for b in range(B):
        for _ in range(s_q):
            pos = torch.randperm(L, generator=gen)[:topk]
            flat.append(block_table[b, pos // PAGE].to(torch.int64) * PAGE + pos % PAGE)
    flat = torch.cat(flat).to(torch.int32)
    indptr = torch.arange(B * s_q + 1, dtype=torch.int32) * topk
    batch = DecodeBatch(seq_lens=torch.full((B,), L, dtype=torch.int32), q_lens=torch.full((B,), s_q, dtype=torch.int32),
                        block_table=block_table, slot_mapping=torch.full((B, s_q), -1, dtype=torch.int64),
                        page_size=PAGE, next_n=s_q, pad_to=B, kv_dtype=kv, topk_flat=flat, topk_indptr=indptr, topk=topk)
    be = TritonMLABackend(spec_h, device="cuda", max_batch=B, capture_sizes=[B], next_n_max=s_q,
                          max_blocks_per_seq=pages, page_size=PAGE, topk_max=topk)
    md = be.build(batch)
    q, out, t_ms, t_db = _time_graph_replay(be, md, cache, spec, B, s_q, h)
    kv_bytes = B * s_q * topk * BYTES_PER_TOKEN[kv]
    io_bytes = kv_bytes + q.numel() * 2 + out.numel() * 2 + flat.numel() * 4
    flops = 2.0 * B * s_q * h * topk * (spec.d_qk + spec.kv_lora_rank)
    return t_ms, io_bytes, flops, md.config, dict(time_us_do_bench=t_db * 1e3)


def candidate_configs(rows: int, sms: int, kv: str):
    """A few launch configs of the Triton kernel per row class (s_q * heads) and kv dtype, one
    program per SM (a second wave lost in every case of the first sweep). Tuples: block_m,
    block_n, warps, stages."""
    if kv == "fp8":
        if rows <= 32:
            bm = 16 if rows <= 16 else 32
            shapes = [(bm, 64, 8, 1), (bm, 64, 8, 2), (bm, 32, 8, 1), (bm, 128, 8, 2)]
            if rows > 16:  # the 64-row block, padding rows masked (the default there)
                shapes.append((64, 128, 8, 1))
        else:
            shapes = [(64, 128, 8, 1), (64, 64, 8, 2), (64, 32, 8, 1)]
    elif rows <= 16:
        shapes = [(16, 64, 4, 2), (16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 8, 2)]
    elif rows <= 32:
        shapes = [(32, 64, 4, 2), (32, 32, 4, 3), (16, 64, 4, 2), (32, 64, 8, 2)]
    else:
        shapes = [(64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 8, 3)]
    out = []
    for shape in shapes:
        bm, bn, w, st = shape
        m_blocks = -(-rows // bm)
        out.append(DecodeConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                                num_parts=max(1, sms // m_blocks), min_tiles_per_part=2))
    return out


def cfg_dict(c: DecodeConfig) -> dict:
    return dict(block_m=c.block_m, block_n=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
                num_parts=c.num_parts, min_tiles_per_part=c.min_tiles_per_part, kernel=c.kernel)


def summarize(results: list) -> dict:
    """The grid's headline figures (issue 3's targets and their context) from its case records
    (``results`` of the json: dicts with ``kv``, ``h``, ``s_q``, ``B``, ``L``, ``time_us``,
    ``bw_ratio``, ``flop_ratio``, ``x_roofline``, ``roofline_us``, ``time_us_do_bench`` and the read
    references' fields). A headline over no case is None."""
    def pick(f):
        return [r for r in results if f(r)]

    mem = pick(lambda r: r["h"] == 16 and r["B"] * r["L"] >= 128 * 1024)
    comp = pick(lambda r: r["h"] == 128 and r["s_q"] == 2)
    big = pick(lambda r: r["B"] >= 32)
    return {
        "mem_bound_h16_BL>=128k_min_bw_ratio": min((r["bw_ratio"] for r in mem), default=None),
        # medians of an even count: the mean of the middle two (before 2026-11-26's kernel-17
        # run, the upper one of them)
        "mem_bound_h16_BL>=128k_median_bw_ratio": statistics.median(r["bw_ratio"] for r in mem) if mem else None,
        "h128_sq2_max_flop_ratio": max((r["flop_ratio"] for r in comp), default=None),
        "h128_sq2_median_flop_ratio": statistics.median(r["flop_ratio"] for r in comp) if comp else None,
        "B>=32_worst_x_roofline": max((r["x_roofline"] for r in big), default=None),
        # the same headlines on do_bench's times (its flush leaves dirty lines: module doc)
        "do_bench_mem_bound_h16_BL>=128k_min_bw_ratio": min((r["bw_ratio"] * r["time_us"] / r["time_us_do_bench"] for r in mem),
                                                             default=None),
        "do_bench_B>=32_worst_x_roofline": max((r["time_us_do_bench"] / r["roofline_us"] for r in big), default=None),
        # how close a plain torch read of the same bytes comes to the copy rate (the 75% target's context)
        "mem_bound_h16_BL>=128k_min_read_ref_bw_ratio": min((r["read_ref_bw_ratio"] for r in mem), default=None),
        "mem_bound_h16_BL>=128k_worst_x_read_ref": max((r["x_read_ref"] for r in mem), default=None),
        # the same against the Triton read floor (replay_timing module doc)
        "mem_bound_h16_BL>=128k_min_read_floor_bw_ratio": min((r["read_floor_bw_ratio"] for r in mem), default=None),
        "mem_bound_h16_BL>=128k_worst_x_read_floor": max((r["x_read_floor"] for r in mem), default=None),
        "B>=32_worst_read_floor_x_roofline": max((r["read_floor_us"] / r["roofline_us"] for r in big), default=None),
        "cases": len(results),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--sweep", action="store_true", help="tune launch configs on representative cases first")
    ap.add_argument("--sweep-kv", default="bf16,fp8", help="kv dtypes to sweep (others use default_config)")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--sq", default="1,2")
    ap.add_argument("--batch", default="1,8,32,128")
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--sparse", action="store_true", help="run the sparse top-k case set (see module doc) instead")
    ap.add_argument("--topk", type=int, default=2048, help="top-k of the sparse case set")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    copy_tbps = measure_copy_tbps()
    mm_tflops = measure_matmul_tflops()
    print(f"# {props.name}: copy {copy_tbps:.2f} TB/s (read+write), bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    if args.sparse:
        return sparse_main(args, t_start, gen, props, copy_tbps, mm_tflops)
    heads = [int(x) for x in args.heads.split(",")]
    sqs = [int(x) for x in args.sq.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    lens = [int(x) for x in args.lens.split(",")]
    kvs = args.kv.split(",")
    spec = ModelSpec()
    pool = CachePool(spec, max(batches) * max(lens))
    read_ref = ReadReference(max(batches) * max(lens) * max(BYTES_PER_TOKEN[kv] for kv in kvs), l2_flush())

    def roof(io_bytes, flops):
        return roofline_ms(io_bytes, flops, copy_tbps, mm_tflops)

    chosen = {}
    sweep_rows = []
    if args.sweep:
        reps = [(32, 4096), (128, 1024)]
        for kv in args.sweep_kv.split(","):
            for h in heads:
                for s_q in sqs:
                    rows = h * s_q
                    best = None
                    for cfg in candidate_configs(rows, sms, kv):
                        tot = 0.0
                        for B, L in reps:
                            try:
                                t_ms, io, fl = run_case(spec, pool, h, s_q, B, L, kv, cfg, gen)
                            except Exception as e:  # e.g. OutOfResources: this config does not fit
                                print(f"sweep {kv} h={h} s_q={s_q} {cfg_dict(cfg)}: {type(e).__name__}: {e}"[:300],
                                      flush=True)
                                tot = math.inf
                                break
                            tot += math.log(t_ms / roof(io, fl))
                            sweep_rows.append(dict(kv=kv, h=h, s_q=s_q, B=B, L=L, config=cfg_dict(cfg), time_us=t_ms * 1e3,
                                                   x_roofline=t_ms / roof(io, fl)))
                        print(f"sweep {kv} h={h} s_q={s_q} {cfg_dict(cfg)} geo-mean x_roof={math.exp(tot / len(reps)):.2f}", flush=True)
                        if best is None or tot < best[0]:
                            best = (tot, cfg)
                    chosen[(kv, h, s_q)] = best[1]

    results = []
    for kv in kvs:
        for h in heads:
            for s_q in sqs:
                swept = chosen.get((kv, h, s_q))
                for B in batches:
                    # the backend's own choice: default_config at the case's (padded) batch size
                    cfg = swept or default_config(ModelSpec(num_heads=h), s_q, torch.device("cuda"), fp8=kv == "fp8",
                                                  batch=B)
                    for L in lens:
                        if time.time() - t_start > args.budget_s:
                            print("# budget reached; remaining cases skipped", flush=True)
                            break
                        try:
                            m = measure_case(spec, pool, h, s_q, B, L, kv, cfg, gen)
                            ref_us = read_ref.read_ref_ms(m["kv_bytes"]) * 1e3
                            floor_us = read_ref.read_floor_ms(m["kv_bytes"]) * 1e3
                        except Exception as e:
                            print(f"{kv} h={h} s_q={s_q} B={B} L={L}: {type(e).__name__}: {e}"[:300], flush=True)
                            continue
                        r = case_record(dict(kv=kv, h=h, s_q=s_q, B=B, L=L, config=cfg_dict(cfg)), m["ms"],
                                        m["io_bytes"], m["flops"], copy_tbps, mm_tflops)
                        r.update(time_us_do_bench=m["time_us_do_bench"], read_ref_us=ref_us,
                                 x_read_ref=r["time_us"] / ref_us,
                                 read_ref_bw_ratio=m["kv_bytes"] / (ref_us * 1e-6) / 1e12 / copy_tbps,
                                 read_floor_us=floor_us, x_read_floor=r["time_us"] / floor_us,
                                 read_floor_bw_ratio=m["kv_bytes"] / (floor_us * 1e-6) / 1e12 / copy_tbps)
                        results.append(r)
                        print(f"{kv:4s} h={h:3d} s_q={s_q} B={B:3d} L={L:5d} {r['time_us']:9.1f} us "
                              f"{r['TBps']:5.2f} TB/s ({r['bw_ratio']:.0%}) {r['TFLOPs']:6.1f} TF/s "
                              f"({r['flop_ratio']:.0%}) x{r['x_roofline']:.2f} roof, x{r['x_read_ref']:.2f} a plain "
                              f"read ({r['read_ref_us']:.1f} us), x{r['x_read_floor']:.2f} the read floor "
                              f"({floor_us:.1f} us); do_bench {r['time_us_do_bench']:.1f} us", flush=True)

    summary = summarize(results)
    print("# summary " + json.dumps(summary), flush=True)
    doc = {
        "gpu": props.name, "sms": sms, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "copy_TBps_read_plus_write": copy_tbps, "matmul_bf16_TFLOPs": mm_tflops, "rate_trials": dict(RATE_LOG),
        "timing": TIMING_NOTE,
        "summary": summary, "results": results, "sweep": sweep_rows,
        "chosen": {f"{k[0]}/h{k[1]}/sq{k[2]}": cfg_dict(v) for k, v in chosen.items()},
        "wall_s": time.time() - t_start,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def sparse_main(args, t_start, gen, props, copy_tbps, mm_tflops) -> int:
    """The ``--sparse`` case set: h=128, s_q=2, topk=args.topk, bf16 and FP8."""
    spec = ModelSpec()
    h, s_q, topk = 128, 2, args.topk
    batches, lens = [1, 8, 32, 128], [8192, 32768]
    pool = CachePool(spec, max(batches) * max(lens))
    results = []
    for kv in ("bf16", "fp8"):
        for B in batches:
            for L in lens:
                if time.time() - t_start > args.budget_s:
                    print("# budget reached; remaining cases skipped", flush=True)
                    break
                try:
                    t_ms, io, fl, cfg, extra = run_sparse_case(spec, pool, h, s_q, B, L, kv, topk, gen)
                except Exception as e:
                    print(f"sparse {kv} B={B} L={L}: {type(e).__name__}: {e}"[:300], flush=True)
                    continue
                r = case_record(dict(kv=kv, h=h, s_q=s_q, B=B, L=L, topk=topk, config=cfg_dict(cfg)), t_ms, io, fl,
                                copy_tbps, mm_tflops)
                r.update(extra)
                results.append(r)
                print(f"sparse {kv:4s} h={h} s_q={s_q} topk={topk} B={B:3d} L={L:5d} {r['time_us']:9.1f} us "
                      f"{r['TBps']:5.2f} TB/s ({r['bw_ratio']:.0%}) {r['TFLOPs']:6.1f} TF/s ({r['flop_ratio']:.0%}) "
                      f"x{r['x_roofline']:.2f} roof", flush=True)
    summary = {"sparse_cases": len(results),
               "sparse_worst_x_roofline": max((r["x_roofline"] for r in results), default=None),
               "sparse_median_x_roofline": statistics.median(r["x_roofline"] for r in results) if results else None}
    print("# summary " + json.dumps(summary), flush=True)
    doc = {"gpu": props.name, "sms": props.multi_processor_count, "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "copy_TBps_read_plus_write": copy_tbps, "matmul_bf16_TFLOPs": mm_tflops, "rate_trials": dict(RATE_LOG),
           "timing": TIMING_NOTE + " (sparse top-k)",
           "summary": summary, "results": results, "wall_s": time.time() - t_start}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
