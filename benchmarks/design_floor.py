"""The design floor of a decode case: how fast the shipped planner + split-KV + combine design
could run it if the decode kernel were as fast as reading its bytes (GPU only).

Issue 3 asks for the forward to be a device-side planner, a split-KV decode writing fp32
partials, and a combine. Whether a target is out of reach of any decode kernel in that design is
a measurement, not an argument: replay the case's own graph with the decode kernel replaced by
the fastest plain read of the same number of cache bytes we have (``replay_timing``'s read
floor, launched with PDL and waiting for the plan as the decode does), the planner and the
combine launched as shipped on the case's own plan. Four graphs a case, each after a clean L2
flush (``replay_timing.L2Flush``), interleaved over three rounds, the least median kept:

- ``shipped``: planner, decode, combine as the backend runs them;
- ``floor``: planner, read in the decode's place, combine (over partial buffers the read never
  wrote: timing only);
- ``floor_no_combine``: planner and read only (what a design merging inside the decode could
  approach, its merge free);
- ``read_alone``: the read in a graph of its own (``kernel_bench``'s ``read_floor_us``);
- ``three_kernels``: an empty kernel in the planner's place (releasing its dependents at once,
  as the planner does), the read, an empty kernel in the combine's place (launched with PDL,
  waiting): the least any planner + decode + combine graph can take.

The read stores zeros over the partial rows the plan's split requests use (``pieces_used``), as
the decode would, so the combine finds them in L2. A decode kernel also does the dots:
``design_floor_us`` is ``floor_us`` with the read kernel's duration (CUPTI, inside that graph)
replaced by the larger of it and the case's flops at the bf16 matmul rate measured in the same
run; ``design_floor_any_kernels_us`` the same of ``three_kernels``. Both leave out the decode's
result stores, so they are lower bounds. Each case's targets (``kernel_table.target_limits_us``)
are compared with them: ``reachable`` False means no decode kernel, however fast, meets that
target with the shipped planner and combine kernels and the shipped plan (``--parts``: at any of
those part counts either, ``reachable_any_plan``); ``reachable_any_kernels`` False, that no
planner, decode and combine kernels at all do.

    python benchmarks/design_floor.py --misses benchmarks/results/h100-2026-11-27-kernel-33.json
    python benchmarks/design_floor.py --cases "fp8,16,2,8,16384;bf16,128,1,32,1024"
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_fuzz.mla_ref import ModelSpec  # noqa: E402

from mla_fuzz.kernels.hopper.pdl import grid_release, grid_wait  # noqa: E402

#: the graphs timed for each case, in the order each round times them (module doc)
MODES = ("shipped", "floor", "floor_no_combine", "read_alone", "three_kernels")
#: the floor graph's kernels by role (``fixed_cost_bench._kernel_medians``)
FLOOR_ROLES = {"planner": "planner", "read": "_read_kernel", "combine": "combine"}


@contextlib.contextmanager
def read_in_decode_place(stand_in, combine: bool = True):
    """Within the block, ``kernels.ops`` calls ``stand_in`` with the split-KV decode's arguments
    where it would launch the decode, and (``combine`` False) launches no combine kernel;
    restored on exit, also after an error. Timing only: ``out`` and ``lse`` are never written."""
    import mla_fuzz.kernels.ops as ops
    dec, comb = ops.launch_decode, ops.launch_combine
    try:
        ops.launch_decode = stand_in
        if not combine:
            ops.launch_combine = lambda *args, **kw: None
        yield
    finally:
        ops.launch_decode, ops.launch_combine = dec, comb


def pieces_used(num_splits, split_offsets) -> int:
    """Rows of the fp32 partial buffer a plan's split requests use (int32 ``[B]`` each, as the
    planner left them): one past the last piece of any request in more than one piece."""
    ns, off = num_splits.tolist(), split_offsets.tolist()
    return max((o + n for n, o in zip(ns, off) if n > 1), default=0)


def parse_cases(text: str) -> list:
    """``kv,h,s_q,B,L;...`` -> ``[(kv, h, s_q, B, L), ...]`` (``fixed_cost_bench``'s syntax, kv
    ``bf16`` or ``fp8``); ValueError naming a bad item, or for none, or for a zero count or an L
    that is not a positive multiple of 64."""
    from fixed_cost_bench import _parse_cases
    try:
        cases = _parse_cases(text, 5)
    except SystemExit as e:
        raise ValueError(str(e)) from None
    for kv, h, s_q, b, length in cases:
        if min(h, s_q, b) < 1 or length < 64 or length % 64:
            raise ValueError(f"bad case {kv},{h},{s_q},{b},{length}: h, s_q, B >= 1 and L a positive multiple of 64")
    if not cases:
        raise ValueError("no cases given")
    return cases


def misses_of(grid_path: str) -> list:
    """The ``(kv, h, s_q, B, L)`` of every case of a ``kernel_bench`` grid json that misses one of
    issue 3's per-case targets (``kernel_table.misses_target``); ``kernel_table.TableError`` for a
    file that is not such a grid."""
    import kernel_table
    doc = kernel_table.load_grid(grid_path)
    return [(r["kv"], r["h"], r["s_q"], r["B"], r["L"]) for r in doc["results"] if kernel_table.misses_target(r)]


def charged_floor(floor_us: float, read_us: float, flops_us: float) -> float:
    """A floor graph's time (us) with its read kernel's duration ``read_us`` replaced by the larger
    of it and the dots' time at the matmul rate ``flops_us`` (module doc)."""
    return floor_us - read_us + max(read_us, flops_us)


def floor_record(case: tuple, times_us: dict, kernels_us: dict, io_bytes: float, flops: float, copy_tbps: float,
                 mm_tflops: float, three_read_us: float = None) -> dict:
    """One case's record from its graphs' times (``times_us``: mode -> us), the floor graph's
    CUPTI kernel durations (``kernels_us``: ``read``, ``planner``, ``combine``), the read's in
    the three-kernel graph (``three_read_us``, with ``times_us["three_kernels"]``) and its costs
    against this run's rates: roofline, each target's limit, the design floors and whether each
    target is within them (module doc)."""
    import kernel_bench as kb
    import kernel_table
    kv, h, s_q, batch, length = case
    roof_us = kb.roofline_ms(io_bytes, flops, copy_tbps, mm_tflops) * 1e3
    flops_us = flops / (mm_tflops * 1e12) * 1e6
    design = charged_floor(times_us["floor"], kernels_us["read"], flops_us)
    limits = kernel_table.target_limits_us(h, batch, length, io_bytes, roof_us, copy_tbps)
    rec = {"case": list(case), **{m + "_us": v for m, v in times_us.items()},
           "floor_kernels_us": kernels_us, "io_bytes": io_bytes, "flops": flops, "roofline_us": roof_us,
           "flops_at_matmul_rate_us": flops_us, "design_floor_us": design,
           "shipped_x_design_floor": times_us["shipped"] / design,
           "target_limits_us": limits,
           "reachable": {t: design <= lim for t, lim in limits.items()}}
    if three_read_us is not None:
        any_k = charged_floor(times_us["three_kernels"], three_read_us, flops_us)
        rec["design_floor_any_kernels_us"] = any_k
        rec["reachable_any_kernels"] = {t: any_k <= lim for t, lim in limits.items()}
    return rec


@triton.jit
def _stand_in_kernel(WAIT: tl.constexpr, RELEASE: tl.constexpr):
    # an empty kernel in the planner's place (RELEASE: lets the next grid in at once, as the
    # planner does) or the combine's (WAIT: launched with PDL, waits for the decode's grid)
    if WAIT:
        grid_wait()
    if RELEASE:
        grid_release()


def _three_kernels(launch_read, pdl: bool):
    """A function launching the least planner + decode + combine sequence: an empty kernel,
    ``launch_read()`` (launched with PDL where ``pdl``), an empty kernel (module doc)."""
    def run():
        _stand_in_kernel[(1,)](WAIT=False, RELEASE=pdl)
        launch_read()
        _stand_in_kernel[(1,)](WAIT=pdl, RELEASE=False, **({"launch_pdl": True} if pdl else {}))
    return run


def _floor_graphs(c, reader, kv_bytes: int, programs, no_combine: bool) -> dict:
    """Graphs of case ``c`` (``fixed_cost_bench._Case``, run once) with the read in the decode's
    place (``programs``: None for the floor's shape, else that many one-SM programs), storing the
    partial rows the plan's split requests use; ``floor`` and, with ``no_combine``,
    ``floor_no_combine`` (module doc)."""
    from fixed_cost_bench import _graph_of
    from mla_fuzz.kernels.hopper.pdl import pdl_on
    batch = c.q.shape[0]
    pieces = pieces_used(c.md.num_splits[:batch].cpu(), c.md.split_offsets[:batch].cpu())
    wait = pdl_on(c.q)  # the read waits for the plan exactly where the decode would

    def stand_in(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
                 out, lse, partial_o, partial_lse, **kw):
        reader.read_launch(kv_bytes, after_grid=wait, programs=programs,
                           stores=(partial_o[:pieces], partial_lse[:pieces]))()

    graphs = {}
    with read_in_decode_place(stand_in):
        graphs["floor"] = _graph_of(c.forward)
    if no_combine:
        with read_in_decode_place(stand_in, combine=False):
            graphs["floor_no_combine"] = _graph_of(c.forward)
    return graphs


def _time(graphs: dict, flush, reps: int) -> dict:
    """Per graph, the least of three medians (us) of ``reps`` replays, the graphs taken in turn
    each round; ``{name: (least, [medians])}``."""
    from replay_timing import median_replay_ms
    times = {m: [] for m in graphs}
    for _ in range(3):
        for m, g in graphs.items():
            times[m].append(median_replay_ms(g.replay, flush.clean, warmup=5, reps=reps) * 1e3)
    return {m: (min(t), t) for m, t in times.items()}


def run_case(case, pool, reader, flush, gen, reps: int, rates: tuple, parts=(), sweep_all: bool = False) -> dict:
    """Part of ``main``: one case's graphs built (the case's backend at its default config,
    ``fixed_cost_bench._Case``), timed over three interleaved rounds, and its record. With
    ``parts``, where the shipped plan's floor misses a target (or everywhere, ``sweep_all``), the
    floor again at each of those part counts (``by_parts``; each plan's read on as many SMs as
    its decode's programs) and the least design floor over them and the shipped plan
    (``design_floor_any_plan_us``, ``reachable_any_plan``)."""
    import dataclasses

    import kernel_bench as kb
    from fixed_cost_bench import _Case, _graph_of, _kernel_medians
    from mla_fuzz.kernels.hopper.pdl import pdl_on
    kv, h, s_q, batch, length = case
    spec = ModelSpec(num_heads=h)
    io_bytes, flops, kv_bytes = kb.case_cost(spec, h, s_q, batch, length, kv)
    c = _Case(pool, kv, h, s_q, batch, length, gen)
    c.forward()
    graphs = {"shipped": _graph_of(c.forward)}
    graphs.update(_floor_graphs(c, reader, kv_bytes, None, no_combine=True))
    graphs["read_alone"] = _graph_of(reader.read_launch(kv_bytes))
    graphs["three_kernels"] = _graph_of(_three_kernels(reader.read_launch(kv_bytes, after_grid=pdl_on(c.q)),
                                                       pdl_on(c.q)))
    timed = _time(graphs, flush, reps)
    kernels_us = {k: v for k, v in _kernel_medians(graphs["floor"], flush.clean, reps, FLOOR_ROLES).items()
                  if not k.endswith("_name")}
    three_read = _kernel_medians(graphs["three_kernels"], flush.clean, reps, FLOOR_ROLES)["read"]
    rec = floor_record(case, {m: timed[m][0] for m in MODES}, kernels_us, io_bytes, flops, *rates,
                       three_read_us=three_read)
    rec["medians_us"] = {m: timed[m][1] for m in MODES}
    rec["config"] = {"block_m": c.cfg.block_m, "block_n": c.cfg.block_n, "num_parts": c.cfg.num_parts}
    del graphs
    if parts and (sweep_all or not all(rec["reachable"].values())):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        best = rec["design_floor_us"]
        rec["by_parts"] = []
        for n in parts:
            cfg = dataclasses.replace(c.cfg, num_parts=n)
            programs = n * cfg.m_blocks(s_q, h)
            cp = _Case(pool, kv, h, s_q, batch, length, gen, config=cfg)
            cp.forward()
            g = _floor_graphs(cp, reader, kv_bytes, programs if programs < sms else None, no_combine=False)["floor"]
            t = _time({"floor": g}, flush, reps)["floor"][0]
            k = _kernel_medians(g, flush.clean, reps, FLOOR_ROLES)
            design = charged_floor(t, k["read"], rec["flops_at_matmul_rate_us"])
            best = min(best, design)
            rec["by_parts"].append({"num_parts": n, "programs": programs, "floor_us": t, "read_kernel_us": k["read"],
                                    "combine_kernel_us": k.get("combine"), "design_floor_us": design})
            del g
        rec["design_floor_any_plan_us"] = best
        rec["reachable_any_plan"] = {t: best <= lim for t, lim in rec["target_limits_us"].items()}
    return rec


def load_run(path: str) -> dict:
    """A design_floor json read from ``path``; ``kernel_table.TableError`` when the file is
    missing, not json, or has no case records with their floors and limits."""
    import kernel_table
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise kernel_table.TableError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise kernel_table.TableError(f"{path} is not json: {e}") from None
    need = {"case", "shipped_us", "design_floor_us", "design_floor_any_kernels_us", "target_limits_us"}
    cases = doc.get("cases") if isinstance(doc, dict) else None
    if not cases or not all(isinstance(r, dict) and need <= r.keys() for r in cases):
        raise kernel_table.TableError(f"{path} is not a design_floor run (no 'cases' with {sorted(need)})")
    return doc


#: the targets' names in the table
_TARGET_NAMES = {"copy_share": "75% of the copy rate", "x_roofline": "2x the roofline"}


def table(doc: dict) -> str:
    """A markdown table of a design_floor run: a row per case and target it misses, with the
    target's time limit, the shipped replay, and the two design floors (with the shipped planner
    and combine at the best plan tried, and with any kernels); a floor over its limit in bold
    (out of reach). A first line counts them."""
    rows, out_shipped, out_any = [], 0, 0
    for r in doc["cases"]:
        kv, h, s_q, batch, length = r["case"]
        ours = r.get("design_floor_any_plan_us", r["design_floor_us"])
        for t, lim in r["target_limits_us"].items():
            if r["shipped_us"] <= lim:
                continue  # met by this run's shipped replay
            a, b = ours > lim, r["design_floor_any_kernels_us"] > lim
            out_shipped += a
            out_any += b
            cell = (lambda x, bold: f"**{x:.1f} µs**" if bold else f"{x:.1f} µs")
            rows.append(f"| {kv} | {h} | {s_q} | {batch} | {length} | {_TARGET_NAMES.get(t, t)}: {lim:.1f} µs | "
                        f"{r['shipped_us']:.1f} µs | {cell(ours, a)} | {cell(r['design_floor_any_kernels_us'], b)} |")
    parts = any("by_parts" in r for r in doc["cases"])
    head = (f"{doc.get('gpu', '?')}, copy rate {doc.get('copy_TBps', 0):.2f} TB/s, matmul "
            f"{doc.get('matmul_bf16_TFLOPs', 0):.0f} TFLOP/s: of the {len(rows)} targets this run's shipped "
            f"replays miss, {out_shipped} are out of reach of any decode kernel with the shipped planner and "
            f"combine kernels" + (" at every part count tried" if parts else "")
            + f", {out_any} with any planner and combine kernels.\n\n")
    lines = ["| kv | h | s_q | B | L | target: time limit | shipped | floor, shipped planner + combine"
             + (" (best plan tried)" if parts else "") + " | floor, any three kernels |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    return head + "\n".join(lines + rows) + "\n"


def _verdict(reachable: dict, limits: dict = None) -> str:
    # "target within / OUT OF REACH" per target, with its limit where given (progress lines)
    return ", ".join(f"{t} {'within' if ok else 'OUT OF REACH'}" + (f" ({limits[t]:.1f} us)" if limits else "")
                     for t, ok in reachable.items())


def main(argv=None) -> int:
    """The command line (``--help``); returns the exit status (2 on bad input or without a CUDA GPU)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--cases", help="kv,h,s_q,B,L;... (kv bf16 or fp8)")
    src.add_argument("--misses", metavar="GRID.json", help="every case of this kernel_bench grid that misses a target")
    p.add_argument("--reps", type=int, default=40, help="replays a median (default 40)")
    p.add_argument("--parts", default="", help="comma-separated part counts: where a case's floor misses a target, "
                   "its floor at each of these too, the read on as many SMs as the decode's programs (by_parts; "
                   "default none)")
    p.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>-<date>-design-floor.json)")
    a = p.parse_args(argv)
    try:
        if a.cases is not None:
            cases = parse_cases(a.cases)
        else:
            import kernel_table
            try:
                cases = misses_of(a.misses)
            except kernel_table.TableError as e:
                raise ValueError(str(e)) from None
            if not cases:
                raise ValueError(f"{a.misses}: no case misses a target")
        if a.reps < 1:
            raise ValueError("--reps must be >= 1")
        try:
            parts = [int(x) for x in a.parts.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"bad --parts {a.parts!r}: comma-separated integers") from None
        if any(n < 1 for n in parts):
            raise ValueError("--parts must be positive")
    except ValueError as e:
        print(f"design_floor: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("design_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    import kernel_bench as kb
    from fixed_cost_bench import _graph_of
    from replay_timing import L2Flush, ReadReference, median_replay_ms
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)  # the pages each case takes
    pool = kb.CachePool(ModelSpec(), max(b * length for *_, b, length in cases) + 4096)
    flush = L2Flush()
    most = max(b * length * kb.BYTES_PER_TOKEN[kv] for kv, _, _, b, length in cases)
    reader = ReadReference(most + 64, flush)
    rates = (kb.measure_copy_tbps(), kb.measure_matmul_tflops())
    # the two read shapes on every SM, over the largest case's bytes: how near the one-SM
    # programs of a plan's read (--parts) come to the floor's
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {"floor_shape": _graph_of(reader.read_launch(most)),
              "one_program_per_sm": _graph_of(reader.read_launch(most, programs=sms))}
    read_shapes = {"bytes": most, **{k: median_replay_ms(g.replay, flush.clean) * 1e3 for k, g in shapes.items()}}
    del shapes
    res = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "copy_TBps": rates[0], "matmul_bf16_TFLOPs": rates[1],
           "source": a.misses or "--cases", "modes": list(MODES), "read_shapes_us": read_shapes,
           "timing": "CUDA-graph replays after a clean L2 flush, three interleaved rounds of medians of "
                     f"{a.reps}, the least kept; floor kernels' durations by CUPTI", "cases": []}
    for i, case in enumerate(cases):
        rec = run_case(case, pool, reader, flush, gen, a.reps, rates, parts)
        res["cases"].append(rec)
        verdict = _verdict(rec["reachable"], rec["target_limits_us"])
        verdict += (f"; any kernels: {rec['design_floor_any_kernels_us']:.1f} us, "
                    + _verdict(rec["reachable_any_kernels"]))
        if "design_floor_any_plan_us" in rec:
            verdict += f"; any plan: {rec['design_floor_any_plan_us']:.1f} us, " + _verdict(rec["reachable_any_plan"])
        print(f"[{i + 1}/{len(cases)}] {','.join(map(str, case)):>22}: shipped {rec['shipped_us']:.1f}, floor "
              f"{rec['floor_us']:.1f}, design floor {rec['design_floor_us']:.1f} us; {verdict}", flush=True)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"{torch.cuda.get_device_name().split()[1].lower()}-{res['date']}-design-floor.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
