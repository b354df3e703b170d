"""Time the device planner per launch (GPU only).

For B in {1, 8, 32, 128, 1024} (``--batch``), ``num_parts`` 132, ``block_n`` 64,
``min_tiles_per_part`` 2 and random seq lens in [0, 16k], checks the plan against
``plan_reference`` and then times one ``launch_planner`` call:

- ``do_bench_us``: ``triton.testing.do_bench`` median (L2 flushed before every run);
- ``graph_us``: ``--graph-reps`` launches captured in one CUDA graph, replay time divided by
  the count (the planner's real setting: back to back inside a captured decode).

``--baseline`` also times the previous one-program planner (grid ``(1,)``, copied below
verbatim) on the same card, so the two can be compared from one run. ``--sweep`` also
times the new kernel at every ``num_warps`` in {1, 2, 4} x ``BLOCK_P`` in {2, ..., 32}
(the launch heuristic's two knobs; ``BLOCK_B`` stays the padded batch). Prints a table and
writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mla_fuzz.kernels.config import next_pow2  # noqa: E402
from mla_fuzz.kernels import planner as planner_mod  # noqa: E402
from mla_fuzz.kernels.planner import launch_planner, plan_reference  # noqa: E402


# ---- the previous planner (one program, grid (1,)), kept only as a timing baseline

@triton.jit
def _old_tiles_of(seq_ptr, offs, B, BLOCK_N: tl.constexpr):
    lens = tl.load(seq_ptr + offs, mask=offs < B, other=0)
    lens = tl.maximum(lens, 0)
    return (lens + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _old_cdiv64(a, b):
    return (a.to(tl.int64) + b - 1) // b


@triton.jit
def _old_planner_kernel(seq_ptr, part_ptr, nsplit_ptr, off_ptr, B,
                        NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr,
                        BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    offs_b0 = tl.arange(0, BLOCK_B)
    total = 0
    for b0 in range(0, B, BLOCK_B):
        total += tl.sum(_old_tiles_of(seq_ptr, b0 + offs_b0, B, BLOCK_N), axis=0)
    parts_eff = tl.maximum(tl.minimum(NUM_PARTS, total // MIN_TILES), 1)
    total64 = tl.maximum(total, 1).to(tl.int64)
    peff64 = parts_eff.to(tl.int64)
    for p0 in range(0, NUM_PARTS + 1, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        g = (p.to(tl.int64) * total.to(tl.int64) // peff64).to(tl.int32)
        g = tl.where(p <= parts_eff, g, total)
        count = tl.zeros([BLOCK_P], dtype=tl.int32)
        before = tl.zeros([BLOCK_P], dtype=tl.int32)
        carry = 0
        for b0 in range(0, B, BLOCK_B):
            tiles = _old_tiles_of(seq_ptr, b0 + offs_b0, B, BLOCK_N)
            incl = tl.cumsum(tiles, axis=0) + carry
            ends_before = (incl[None, :] <= g[:, None]) & ((b0 + offs_b0) < B)[None, :]
            count += tl.sum(ends_before.to(tl.int32), axis=1)
            before += tl.sum(tl.where(ends_before, tiles[None, :], 0), axis=1)
            carry += tl.sum(tiles, axis=0)
        start_tile = g - before
        live = p < parts_eff
        inner = live & (start_tile > 0)
        first_split = p + 1 - _old_cdiv64((before.to(tl.int64) + 1) * peff64, total64).to(tl.int32)
        first_split = tl.where(inner, first_split, 0)
        row_ok = p <= NUM_PARTS
        tl.store(part_ptr + p * 3 + 0, tl.where(p <= parts_eff, count, B), mask=row_ok)
        tl.store(part_ptr + p * 3 + 1, tl.where(live, start_tile, 0), mask=row_ok)
        tl.store(part_ptr + p * 3 + 2, first_split, mask=row_ok)
    carry = 0
    off_carry = 0
    for b0 in range(0, B, BLOCK_B):
        offs_b = b0 + offs_b0
        tiles = _old_tiles_of(seq_ptr, offs_b, B, BLOCK_N)
        incl = tl.cumsum(tiles, axis=0) + carry
        excl = incl - tiles
        cuts = _old_cdiv64(incl.to(tl.int64) * peff64, total64) - _old_cdiv64((excl.to(tl.int64) + 1) * peff64, total64)
        nsplit = tl.where(tiles > 0, 1 + cuts.to(tl.int32), 0)
        used = tl.where(nsplit > 1, nsplit, 0)
        rows = tl.cumsum(used, axis=0) - used + off_carry
        tl.store(nsplit_ptr + offs_b, nsplit, mask=offs_b < B)
        tl.store(off_ptr + offs_b, rows, mask=offs_b < B)
        carry += tl.sum(tiles, axis=0)
        off_carry += tl.sum(used, axis=0)


def old_launch_planner(cache_seqlens, part_info, num_splits, split_offsets, *, block_n, min_tiles_per_part):
    B = cache_seqlens.shape[0]
    num_parts = part_info.shape[0] - 1
    block_b = min(max(next_pow2(B), 16), 128)
    block_p = min(max(next_pow2(num_parts + 1), 16), 4096 // block_b)
    _old_planner_kernel[(1,)](cache_seqlens, part_info, num_splits, split_offsets, B,
                              NUM_PARTS=num_parts, BLOCK_P=block_p, BLOCK_B=block_b,
                              BLOCK_N=block_n, MIN_TILES=min_tiles_per_part, num_warps=4)


def new_launcher(block_p, num_warps):
    """``launch_planner`` with its two launch knobs forced (for ``--sweep``)."""
    def launch(cache_seqlens, part_info, num_splits, split_offsets, *, block_n, min_tiles_per_part):
        B = cache_seqlens.shape[0]
        num_parts = part_info.shape[0] - 1
        block_b, _, _, req_progs, _ = planner_mod._launch_shape(B, num_parts)
        part_progs = triton.cdiv(num_parts + 1, block_p)
        planner_mod._planner_kernel[(part_progs + req_progs,)](
            cache_seqlens, part_info, num_splits, split_offsets, B,
            NUM_PARTS=num_parts, PART_PROGS=part_progs, BLOCK_P=block_p, BLOCK_B=block_b,
            BLOCK_N=block_n, MIN_TILES=min_tiles_per_part, FUSED=0, num_warps=num_warps)
    return launch


# ---- timing

def time_planner(launch, seq, num_parts, block_n, min_tiles, graph_reps):
    B = seq.shape[0]
    info = torch.full((num_parts + 1, 3), -7, dtype=torch.int32, device="cuda")
    nsplit = torch.full((B,), -7, dtype=torch.int32, device="cuda")
    offsets = torch.full((B,), -7, dtype=torch.int32, device="cuda")

    def fn():
        launch(seq, info, nsplit, offsets, block_n=block_n, min_tiles_per_part=min_tiles)

    fn()
    torch.cuda.synchronize()
    ref = plan_reference(seq.tolist(), num_parts=num_parts, block_n=block_n, min_tiles_per_part=min_tiles)
    ok = (info.tolist(), nsplit.tolist(), offsets.tolist()) == ([list(r) for r in ref[0]], ref[1], ref[2])
    t_bench = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t_graph = triton.testing.do_bench(graph.replay, warmup=5, rep=200, return_mode="median") / graph_reps
    return ok, t_bench * 1e3, t_graph * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--batch", default="1,8,32,128,1024")
    ap.add_argument("--num-parts", type=int, default=132)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--min-tiles", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--graph-reps", type=int, default=50, help="planner launches per captured graph")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the previous one-program planner")
    ap.add_argument("--sweep", action="store_true", help="also time every (num_warps, BLOCK_P) of the new kernel")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("planner_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    impls = [("new", launch_planner)] + ([("old", old_launch_planner)] if args.baseline else [])
    results = []
    print(f"# {props.name}: num_parts {args.num_parts}, block_n {args.block_n}, "
          f"min_tiles {args.min_tiles}, seq lens in [0, {args.max_len}]", flush=True)
    for B in [int(x) for x in args.batch.split(",")]:
        seq = torch.randint(0, args.max_len + 1, (B,), generator=gen, dtype=torch.int32).cuda()
        shape = planner_mod._launch_shape(B, args.num_parts)
        print(f"# B={B}: BLOCK_B {shape[0]}, BLOCK_P {shape[1]}, {shape[2]} part + {shape[3]} request "
              f"programs, num_warps {shape[4]}", flush=True)
        cases = list(impls)
        if args.sweep:
            cases += [(f"w{w}p{bp}", new_launcher(bp, w)) for w in (1, 2, 4) for bp in (2, 4, 8, 16, 32)]
        for name, launch in cases:
            ok, t_bench, t_graph = time_planner(launch, seq, args.num_parts, args.block_n, args.min_tiles,
                                                args.graph_reps)
            r = dict(impl=name, B=B, matches_reference=ok, do_bench_us=t_bench, graph_us=t_graph)
            results.append(r)
            print(f"{name:6s} B={B:5d}  do_bench {t_bench:7.2f} us  graph {t_graph:7.2f} us  "
                  f"{'ok' if ok else 'MISMATCH vs plan_reference'}", flush=True)
    doc = {"gpu": props.name, "sms": props.multi_processor_count, "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "num_parts": args.num_parts, "block_n": args.block_n, "min_tiles_per_part": args.min_tiles,
           "max_len": args.max_len, "graph_reps": args.graph_reps,
           "timing": "do_bench_us: triton.testing.do_bench median per launch (L2 flushed); "
                     "graph_us: CUDA-graph replay of graph_reps launches / graph_reps",
           "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["matches_reference"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
