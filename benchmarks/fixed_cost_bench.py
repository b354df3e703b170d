"""Fixed costs of a decode replay: what a small launch pays whatever its work (GPU only).

Four measurements, one json (``--out``):

1. ``scaling``: for each route (kv dtype, heads, MTP tokens) at one batch size, the key
   length swept: the planner / decode / combine kernels' durations inside a CUDA-graph replay
   after a clean L2 flush (CUPTI through ``torch.profiler``, medians of ``--reps`` replays),
   the replay's own median (CUDA events), and the plan's tiles per part ``T`` (the planner's
   rule, ``kernels/planner.py``). Per route, ``fit``: the least-squares line ``decode_us = a +
   b T`` over the lengths with ``T >= --fit-min-tiles`` whose parts hold at most one request
   start (``T`` no more than a request's tiles): ``b`` is a tile's time in a part,
   ``a`` what the decode kernel costs beyond its tiles (the start of each program, its
   result's stores, the PDL wait).
2. ``timeline`` (``kernel_timeline.py``): inside the pp (bf16 h=128), ws64 (FP8 h=128), rs
   (FP8 h=16 s_q=1) and kt (bf16 h=16) kernels, when the plan becomes visible, q and the first tile land, each of
   the first 16 tiles reaches its QK, the loop ends and the result is stored, per program.
3. ``stores``: one program per SM storing a ``[64, 512]`` fp32 partial (what a split 64-row
   program writes) from the wgmma accumulator's layout (as ``gluon_parts.store_rows_result``),
   from a coalesced layout, and through shared memory into the coalesced one; beside them the
   replay of a graph holding one empty kernel (the floor every replay pays).
4. ``bounds`` (``--bounds``): for each case, what merging split requests costs, as upper
   bounds on what doing it inside the decode could save (timing only; the results of split
   requests are wrong in the last two): the replay as shipped; the same graph timed by
   events recorded inside it (no graph-launch latency); without the combine kernel; and
   without the decode's partial stores (a partial buffer of no rows) as well.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_fuzz.mla_ref import ModelSpec  # noqa: E402

from mla_fuzz.kernels import default_config  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from mla_fuzz.kernels.hopper.gluon_parts import wgmma_layout
except Exception:  # pragma: no cover - a Triton without Gluon
    gluon = None

DEFAULT_ROUTES = "bf16,16,1;bf16,16,2;fp8,16,1;fp8,16,2;bf16,128,1;bf16,128,2;fp8,128,1;fp8,128,2"
DEFAULT_LENGTHS = "64,256,512,1024,2048,4096"
DEFAULT_BOUNDS = "bf16,128,1,32,1024;fp8,128,1,32,1024;bf16,128,2,32,1024;fp8,128,2,32,1024;fp8,128,1,32,4096;" \
                 "bf16,128,1,128,1024;bf16,16,1,32,1024;fp8,16,1,32,1024;bf16,16,1,8,16384;fp8,16,1,8,16384;" \
                 "fp8,16,2,8,16384;fp8,16,2,32,4096"
DEFAULT_TIMELINE = "bf16,128,1,32,256;bf16,128,1,32,1024;bf16,128,2,32,1024;fp8,128,1,32,256;fp8,128,1,32,1024;" \
                   "fp8,128,2,32,1024;bf16,16,2,8,16384;bf16,16,2,32,1024"


def tiles_per_part(batch: int, length: int, block_n: int, num_parts: int, min_tiles: int) -> tuple:
    """The planner's ``(T, P_eff)`` for ``batch`` requests of ``length`` keys each: ``T =
    cdiv(total, P0)``, ``P0`` from ``planner.first_parts``, ``P_eff = cdiv(total, T)``
    (``kernels/planner.py``); ``(0, 0)`` for no keys."""
    from mla_fuzz.kernels.planner import first_parts
    total = batch * -(-length // block_n)
    if total == 0:
        return 0, 0
    p0 = first_parts(total, batch, num_parts=num_parts, min_tiles_per_part=min_tiles)
    t = -(-total // p0)
    return t, -(-total // t)


def fit_line(xs, ys) -> dict:
    """Least-squares ``y = a + b x`` over the points (at least two distinct ``x``): ``{"a", "b",
    "max_residual"}`` (the largest ``|y - a - b x|``)."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs two or more distinct x, got {xs}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {"a": a, "b": b, "max_residual": max(abs(y - a - b * x) for x, y in zip(xs, ys))}


def _parse_cases(text: str, width: int) -> list:
    cases = []
    for item in filter(None, text.split(";")):
        parts = item.split(",")
        if len(parts) != width or parts[0] not in ("bf16", "fp8") or not all(p.isdigit() for p in parts[1:]):
            raise SystemExit(f"bad case {item!r}: expected kv,{'h,s_q' if width == 3 else 'h,s_q,B,L'} with kv "
                             f"bf16 or fp8 and positive integers")
        cases.append((parts[0], *[int(p) for p in parts[1:]]))
    return cases


def _graph_of(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


#: the forward's kernels by role: a substring of each kernel's name
ROLES = {"planner": "planner", "decode": "decode", "combine": "combine"}


def _kernel_medians(g, flush, reps: int, roles: dict = ROLES) -> dict:
    """Median CUPTI duration (us) of each role's kernel (``roles``: role -> a substring of its
    name; the planner, decode and combine by default) over ``reps`` replays of graph ``g``, each
    after ``flush()``; ``<role>_name`` the kernel's name."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            g.replay()
        torch.cuda.synchronize()
    per = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        for role, name in roles.items():
            if name in e.name:
                per[role].append(e.time_range.end - e.time_range.start)
                per[role + "_name"] = e.name
    return {k: (v if k.endswith("_name") else sorted(v)[len(v) // 2]) for k, v in per.items()}


class _Case:
    """One (kv, h, s_q, B, L) launch at the default config (or ``config``):
    ``kernel_bench.build_case``'s backend with a random bf16 q and an output buffer."""

    def __init__(self, pool, kv, h, s_q, batch, length, gen, config=None):
        import kernel_bench as kb
        spec = ModelSpec(num_heads=h)
        self.cfg = config or default_config(spec, s_q, torch.device("cuda"), fp8=kv == "fp8", batch=batch)
        self.be, self.md, self.cache = kb.build_case(pool, h, s_q, batch, length, kv, self.cfg, gen)
        self.q = torch.randn(batch, s_q, h, spec.d_qk, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(batch, s_q, h, spec.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
        self.programs = self.cfg.num_parts * self.cfg.m_blocks(s_q, h)

    def forward(self):
        self.be.forward(self.q, self.cache, self.md, out=self.out)


def run_scaling(pool, routes, batch, lengths, reps, fit_min, flush, gen) -> dict:
    """Part 1 (module doc): per route ``(kv, h, s_q)`` and length, one row of kernel durations
    (us) and plan facts; per route the fit of the decode's duration against ``T``. ``pool`` a
    ``kernel_bench.CachePool``, ``flush`` an ``L2Flush``, ``gen`` the CPU generator that picks
    each case's pages. Returns ``{"rows": [...], "fit": {"kv,h,s_q": {"a", "b", ...}}}``."""
    from replay_timing import median_replay_ms
    rows, fits = [], {}
    for kv, h, s_q in routes:
        pts = []
        for length in lengths:
            c = _Case(pool, kv, h, s_q, batch, length, gen)
            g = _graph_of(c.forward)
            t, p_eff = tiles_per_part(batch, length, c.cfg.block_n, c.cfg.num_parts, c.cfg.min_tiles_per_part)
            r = {"kv": kv, "h": h, "s_q": s_q, "B": batch, "L": length, "block_n": c.cfg.block_n,
                 "num_parts": c.cfg.num_parts, "m_blocks": c.cfg.m_blocks(s_q, h), "T": t, "P_eff": p_eff,
                 "replay_us": median_replay_ms(g.replay, flush.clean, reps=reps) * 1e3}
            r.update({f"{k}_us" if not k.endswith("_name") else k: v
                      for k, v in _kernel_medians(g, flush.clean, reps).items()})
            rows.append(r)
            # fitted: parts of at least fit_min tiles that hold at most one request start (a
            # part over many short requests pays each one's start: another line)
            if t >= fit_min and t <= -(-length // c.cfg.block_n) and r.get("decode_us") is not None:
                pts.append((t, r["decode_us"]))
            print(json.dumps(r), flush=True)
            del g
        if len({t for t, _ in pts}) >= 2:
            fits[f"{kv},{h},{s_q}"] = dict(fit_line(*zip(*pts)), points=len(pts))
    return {"rows": rows, "fit": fits}


def run_timeline(pool, cases, reps, flush, gen) -> list:
    """Part 2: for each ``(kv, h, s_q, B, L)`` (``kernel_timeline.kernel_for`` names its kernel),
    ``reps`` flushed replays of the instrumented kernel; the last one's ``kernel_timeline.summarize`` and every replay's
    latest result store (us after the first program's entry)."""
    import kernel_timeline as kt
    out = []
    for kv, h, s_q, batch, length in cases:
        c = _Case(pool, kv, h, s_q, batch, length, gen)
        ts = torch.zeros(c.programs, kt.SLOTS, dtype=torch.int64, device="cuda")
        restore = kt.install(ts)
        try:
            g = _graph_of(c.forward)
            runs = []
            for _ in range(reps):
                ts.zero_()
                flush.clean()
                g.replay()
                torch.cuda.synchronize()
                runs.append(ts.clone())
        finally:
            restore()
        kernel = kt.kernel_for(kv, h, s_q)
        last = kt.summarize(runs[-1], kt.EVENTS[kernel])
        e = kt.STORED[kernel]
        stored = [kt.summarize(r, {e: "stored"}) for r in runs]
        r = {"case": [kv, h, s_q, batch, length], "kernel": kernel, "last_replay": last,
             "stored_max_each_replay": [s[f"{e}: stored"][2] for s in stored]}
        out.append(r)
        print(json.dumps(r), flush=True)
        del g
    return out


if gluon is not None:
    @gluon.jit
    def _partial_store_kernel(out_ptr, MODE: gl.constexpr):
        # one [64, 512] fp32 block a program: MODE 0 from the 8-warp wgmma accumulator layout,
        # 1 from a coalesced one (a warp 512 contiguous bytes), 2 through shared memory into it
        M: gl.constexpr = 64
        N: gl.constexpr = 512
        ACC_L: gl.constexpr = wgmma_layout([4, 2], 256)
        BL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[8, 1],
                                            order=[1, 0])
        pid = gl.program_id(0)
        base = out_ptr + pid.to(gl.int64) * (M * N)
        rb = gl.arange(0, M, layout=gl.SliceLayout(1, BL))
        cb = gl.arange(0, N, layout=gl.SliceLayout(0, BL))
        if MODE == 1:
            gl.store(base + rb[:, None] * N + cb[None, :], gl.full([M, N], 1.0, gl.float32, BL) * pid.to(gl.float32))
        else:
            v = gl.full([M, N], 1.0, gl.float32, ACC_L) * pid.to(gl.float32)
            if MODE == 0:
                ra = gl.arange(0, M, layout=gl.SliceLayout(1, ACC_L))
                ca = gl.arange(0, N, layout=gl.SliceLayout(0, ACC_L))
                gl.store(base + ra[:, None] * N + ca[None, :], v)
            else:
                SH: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
                s = gl.allocate_shared_memory(gl.float32, [M, N], SH)
                s.store(v)
                gl.thread_barrier()
                gl.store(base + rb[:, None] * N + cb[None, :], s.load(BL))

    @gluon.jit
    def _empty_kernel(x_ptr):
        pass


def run_stores(flush, reps) -> dict:
    """Part 3: replay medians (us) of a graph holding one empty kernel and of one program per
    SM (and a quarter, and one) storing a ``[64, 512]`` fp32 block in each layout; every store
    is checked against the values it must write."""
    from replay_timing import median_replay_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros(1, device="cuda")
    res = {"empty_graph_us": median_replay_ms(_graph_of(lambda: _empty_kernel[(sms,)](x)).replay, flush.clean,
                                              reps=reps) * 1e3, "rows": []}
    buf = torch.empty(sms * 64 * 512, dtype=torch.float32, device="cuda")
    for programs in (1, sms // 4, sms):
        for mode, what in ((0, "wgmma layout"), (1, "coalesced"), (2, "via shared memory")):
            buf.fill_(-1.0)
            g = _graph_of(lambda: _partial_store_kernel[(programs,)](buf, MODE=mode, num_warps=8))
            t = median_replay_ms(g.replay, flush.clean, reps=reps) * 1e3
            want = torch.arange(programs, device="cuda", dtype=torch.float32).repeat_interleave(64 * 512)
            if not torch.equal(buf[:programs * 64 * 512], want):
                raise RuntimeError(f"store kernel mode {mode} wrote wrong values")
            r = {"programs": programs, "layout": what, "MB": programs * 64 * 512 * 4 / 1e6, "replay_us": t}
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
    return res


#: the four ways ``run_bounds`` times a case (the module doc, part 4)
BOUND_MODES = ("shipped", "in_graph", "no_combine", "no_partials_no_combine")


@contextlib.contextmanager
def without_merge(combine: bool, partials: bool):
    """Within the block, ``kernels.ops`` launches no combine kernel (``combine``) and hands the
    decode partial buffers of no rows (``partials``: the kernels store a partial only below that
    capacity, so split pieces store nothing); restored on exit, also after an error. Timing only:
    split requests' ``out`` / ``lse`` are then never written."""
    import mla_fuzz.kernels.ops as ops
    dec, comb = ops.launch_decode, ops.launch_combine

    def decode_without_partials(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info,
                                num_splits, split_offsets, out, lse, partial_o, partial_lse, **kw):
        return dec(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                   split_offsets, out, lse, partial_o[:0], partial_lse[:0], **kw)

    try:
        if combine:
            ops.launch_combine = lambda *args, **kw: None
        if partials:
            ops.launch_decode = decode_without_partials
        yield
    finally:
        ops.launch_decode, ops.launch_combine = dec, comb


def _in_graph_ms(fn, flush, reps: int) -> float:
    """Median time (ms) between two CUDA events recorded inside a graph around ``fn``, over
    ``reps`` replays each after ``flush()`` (10 more untimed first): the graph's work without
    the latency of launching it."""
    e0, e1 = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        e0.record()
        fn()
        e1.record()
    times = []
    for i in range(10 + reps):
        flush()
        g.replay()
        torch.cuda.synchronize()
        if i >= 10:
            times.append(e0.elapsed_time(e1))
    return sorted(times)[len(times) // 2]


def run_bounds(pool, cases, reps, flush, gen) -> list:
    """Part 4: per ``(kv, h, s_q, B, L)``, the median (us) of each of ``BOUND_MODES``, each
    timed twice in turn (the order shipped, in-graph, no combine, no partials, then again),
    with the plan's split requests and pieces."""
    from replay_timing import median_replay_ms
    out = []
    for kv, h, s_q, batch, length in cases:
        c = _Case(pool, kv, h, s_q, batch, length, gen)
        c.forward()
        nsplit = c.md.num_splits[:batch].cpu()
        r = {"case": [kv, h, s_q, batch, length], "split_requests": int((nsplit > 1).sum()),
             "pieces_of_split_requests": int(nsplit[nsplit > 1].sum())}
        for _ in range(2):
            for mode in BOUND_MODES:
                with without_merge(combine=mode.startswith("no_"), partials=mode == "no_partials_no_combine"):
                    if mode == "in_graph":
                        t = _in_graph_ms(c.forward, flush.clean, reps)
                    else:
                        g = _graph_of(c.forward)
                        t = median_replay_ms(g.replay, flush.clean, reps=reps)
                        del g
                r.setdefault(mode + "_us", []).append(t * 1e3)
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def main(argv=None) -> int:
    """The command line (``--help``); returns the exit status (2 without a CUDA GPU or Gluon)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>-<date>-fixed-cost.json)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated key lengths (multiples of 64)")
    p.add_argument("--routes", default=DEFAULT_ROUTES, help="kv,h,s_q;... (kv bf16 or fp8)")
    p.add_argument("--timeline", default=DEFAULT_TIMELINE, help="kv,h,s_q,B,L;... for the in-kernel timeline "
                   "(h=128: the pp and ws64 kernels; FP8 h=16 s_q=1: rs; bf16 h=16: kt); empty to skip")
    p.add_argument("--fit-min-tiles", type=int, default=4)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-stores", action="store_true")
    p.add_argument("--bounds", default=DEFAULT_BOUNDS, help="kv,h,s_q,B,L;... timed with and without the merge of "
                   "split requests (part 4); empty to skip")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fixed_cost_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if gluon is None:
        print("fixed_cost_bench needs Triton's Gluon (triton >= 3.5)", file=sys.stderr)
        return 2
    try:
        lengths = [int(x) for x in a.lengths.split(",") if x]
    except ValueError:
        raise SystemExit(f"bad --lengths {a.lengths!r}: comma-separated integers")
    if a.batch < 1 or not lengths or any(x < 64 or x % 64 for x in lengths):
        raise SystemExit("--batch must be >= 1 and every length a positive multiple of 64")
    routes = _parse_cases(a.routes, 3)
    timeline = _parse_cases(a.timeline, 5)
    bounds = _parse_cases(a.bounds, 5)
    import kernel_timeline as kt
    for kv, h, s_q, _, _ in timeline:
        if kt.kernel_for(kv, h, s_q) is None:
            raise SystemExit(f"timeline case {kv},{h},{s_q}: no instrumented kernel runs it (the 64-row kernels, "
                             f"more than 32 query rows; FP8 at up to 16 rows; 16-bit at up to 32)")
    import kernel_bench as kb
    from replay_timing import L2Flush
    torch.manual_seed(0)  # q and the caches
    gen = torch.Generator().manual_seed(0)  # the pages each case takes
    need = max([a.batch * max(lengths)] + [b * length for _, _, _, b, length in timeline + bounds])
    pool = kb.CachePool(ModelSpec(), need + 4096)
    flush = L2Flush()
    res = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "timing": "CUDA-graph replays of TritonMLABackend.forward, each after a 256 MB read (clean L2 flush); "
                     "kernel durations from CUPTI (torch.profiler), medians",
           "scaling": run_scaling(pool, routes, a.batch, lengths, a.reps, a.fit_min_tiles, flush, gen)}
    if timeline:
        res["timeline"] = run_timeline(pool, timeline, 7, flush, gen)
    if not a.no_stores:
        res["stores"] = run_stores(flush, 100)
    if bounds:
        res["bounds"] = run_bounds(pool, bounds, 60, flush, gen)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"{torch.cuda.get_device_name().split()[1].lower()}-{res['date']}-fixed-cost.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for route, fit in res["scaling"]["fit"].items():
        print(f"{route:>12}: decode = {fit['a']:.1f} us + {fit['b']:.2f} us x tiles per part "
              f"(max residual {fit['max_residual']:.1f} us, {fit['points']} points)")
    for r in res.get("bounds", []):
        med = {m: sorted(r[m + "_us"])[0] for m in BOUND_MODES}
        print(f"{','.join(map(str, r['case'])):>22}: " + ", ".join(f"{m} {v:.1f}" for m, v in med.items())
              + f" us (best of two; {r['split_requests']} split requests)")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
