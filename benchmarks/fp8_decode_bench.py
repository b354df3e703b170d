"""FP8 split-KV decode: the grouped-dot path against the dequantise path (GPU only).

``kernels.decode_split`` has two FP8 paths, picked by module switches read at every launch:

- ``dequant``: e4m3 -> fp32 times the group scale via a ``[BLOCK_N, groups, GROUP]`` view,
  cast to bf16, then the dots (``FP8_GROUPED_DOTS = False``; the path before the change);
- ``grouped``: codes -> fp16 (``FP8_FP16_DOTS``, as shipped; bf16 before it) straight into
  per-quarter dots, group scales applied to the dot results and to P
  (``FP8_GROUPED_DOTS = True``), with *twin loads* where they apply (``num_stages >= 2``, no
  ``fp8_prefetch``, ``block_m <= 32``);
- ``grouped-single``: the grouped path with ``FP8_TWIN_LOADS = False`` (one synchronous load
  per code tile), timed where twin loads would apply, to show what they are worth.

Both run ``TritonMLABackend.forward`` (planner + decode + combine) captured in a CUDA graph,
timed as ``benchmarks/kernel_bench`` times (median replay after a clean L2 flush), via its
``CachePool`` / ``run_case`` (DeepSeek-V3 dims, page 64, h = 16 query heads).

1. Sweep (one representative case per s_q, ``--sweep-case``, default B=128 L=4096): launch
   configs ``block_n in {32, 64, 128} x num_warps in {4, 8} x num_stages in {1, 2, 3}`` (plus
   ``fp8_prefetch`` at ``num_stages = 1``) for ``grouped``; the shipped default and the
   previously swept FP8 candidates (``kernel_bench.candidate_configs``) for ``dequant``; the
   ``num_stages >= 2`` configs of ``block_n`` 32/64 with 8 warps for ``grouped-single``.
   ``block_m`` follows the rows (16 for s_q=1, 32 for s_q=2), one persistent program per SM.
2. Grid: ``s_q in {1, 2} x B in {32, 128} x L in {1k, 4k, 16k}`` for ``dequant`` and
   ``grouped`` at the shipped ``default_config`` and at each one's sweep winner.

3. ``--tma``: instead of 1 and 2, the TMA path (``FP8_TMA``, module doc of
   ``kernels.decode_split``) against the pointer path, on the same grid: per s_q the
   shipped ``default_config`` with ``FP8_TMA = False`` (``ptr@default``, the baseline) and
   with ``FP8_TMA = True`` at ``num_stages`` 2, 3, 4 (``tma@st<n>``; the default config's
   ``num_stages=1`` is read as ``FP8_TMA_STAGES`` by the TMA path), plus the other FP8 path
   (``fp8_grouped`` flipped) with TMA at 3 stages (``tma-other@st3``). Every row records the
   host's ``fp8_tma_plan`` (taken or not, stages compiled, reason), time, TB/s, the ratio
   to the measured copy bandwidth and the speedup over ``ptr@default``. Give it
   ``--budget-s 420`` or so: ~60 measurements.
4. ``--f16``: the fp16 dots of the grouped path (``FP8_FP16_DOTS``, module doc of
   ``kernels.decode_split``, "FP16 dots") against its bf16 dots, on the same grid: per s_q
   the shipped ``default_config`` with every switch as shipped (``shipped@default``, the
   baseline: the dequantise path with TMA at s_q=1, the grouped one at s_q=2), then the
   grouped path forced (``fp8_grouped=True``) with ``FP8_FP16_DOTS`` True / False
   (``f16-*`` / ``bf16-*``), by pointer loads at ``num_stages`` 1 with ``fp8_prefetch``
   (``@st1pf``), 2 and 3 (twin loads), and through TMA at 2 and 3 stages where it applies
   (16-row blocks, s_q=1; its ``num_stages=1`` would repeat 3). Rows as for ``--tma``, with
   the speedup over ``shipped@default``. ~110 measurements and ~18 kernels to compile:
   ``--budget-s 280`` finishes within ~300 s on an H100.

5. ``--pmem``: P through memory (``P_VIA_MEMORY``, module doc of ``kernels.decode_split``,
   "P through memory") at h = 128 query heads (64-row blocks, the dequantise path), on the
   same grid: per s_q the former default config (64-key tiles, 2 stages, parts of >= 2 tiles) with the switch off
   (``off@bn64st2``, the baseline) and on, and the shipped ``default_config`` (128-key tiles,
   1 stage) off and on. Rows as for ``--tma`` plus TFLOP/s. 48 measurements, 8 kernels.

``--dry-run`` prints the planned settings (configs, switches, and the TMA decision an sm_90
device would get) without a GPU.

Compiling ~60 kernel variants would take most of the time budget, so ``--jobs`` worker
processes first compile them into Triton's on-disk cache (each runs one tiny case per
config); the timing process then only loads them. Prints tables; ``--out`` writes JSON.
Stops starting new measurements after ``--budget-s`` seconds (default 110).

    python benchmarks/fp8_decode_bench.py --out benchmarks/results/<gpu>-<date>-fp8-decode.json
    python benchmarks/fp8_decode_bench.py --tma --budget-s 420 --out benchmarks/results/<gpu>-<date>-fp8-tma.json
    python benchmarks/fp8_decode_bench.py --f16 --budget-s 280 --out benchmarks/results/<gpu>-<date>-fp8-f16.json
    python benchmarks/fp8_decode_bench.py --pmem --budget-s 200 --out benchmarks/results/<gpu>-<date>-fp8-pmem.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)

import kernel_bench as kb  # noqa: E402
from mla_fuzz.mla_ref import ModelSpec  # noqa: E402

from mla_fuzz.kernels import DecodeConfig, default_config  # noqa: E402
import mla_fuzz.kernels.decode_split as ds  # noqa: E402
import mla_fuzz.kernels.decode_wgmma as dw  # noqa: E402

# This benchmark times the Triton kernel's FP8 paths. On Hopper the shipped configs of h=16
# FP8 and of 64-row blocks run the Gluon kernel (kernels/decode_wgmma.py) instead; it is off
# here, so "shipped" below means the Triton kernel's defaults (benchmarks/kernel_bench.py
# times what ships).
dw.WGMMA_DECODE = False

HEADS = 16
SWITCHES = ("FP8_GROUPED_DOTS", "FP8_TWIN_LOADS", "FP8_TMA", "FP8_FP16_DOTS", "P_VIA_MEMORY")
#: the module switches as shipped (read at import, in the workers too)
SHIPPED = {k: getattr(ds, k) for k in SWITCHES}
_PMEM = dict(P_VIA_MEMORY=True)  # P through memory only applies at 64-row blocks (h=128)
VARIANTS = {  # module switches of kernels.decode_split per variant (all of SWITCHES set every time)
    "dequant": dict(FP8_GROUPED_DOTS=False, FP8_TWIN_LOADS=True, FP8_TMA=False, FP8_FP16_DOTS=True, **_PMEM),
    "grouped": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=False, FP8_FP16_DOTS=True, **_PMEM),
    "grouped-single": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=False, FP8_TMA=False, FP8_FP16_DOTS=True, **_PMEM),
    # --tma: the path follows the config (fp8_grouped), loads by pointer or through TMA
    "ptr": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=False, FP8_FP16_DOTS=True, **_PMEM),
    "tma": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=True, FP8_FP16_DOTS=True, **_PMEM),
    # --f16: everything as shipped (the baseline); the grouped path's fp16 / bf16 dots by
    # pointer loads or through TMA
    "shipped": dict(SHIPPED),
    "f16-ptr": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=False, FP8_FP16_DOTS=True, **_PMEM),
    "bf16-ptr": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=False, FP8_FP16_DOTS=False, **_PMEM),
    "f16-tma": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=True, FP8_FP16_DOTS=True, **_PMEM),
    "bf16-tma": dict(FP8_GROUPED_DOTS=True, FP8_TWIN_LOADS=True, FP8_TMA=True, FP8_FP16_DOTS=False, **_PMEM),
    # --pmem: everything as shipped, P through memory off / on (h=128)
    "pmem-off": dict(SHIPPED, P_VIA_MEMORY=False),
    "pmem-on": dict(SHIPPED, P_VIA_MEMORY=True),
}
assert all(set(v) == set(SWITCHES) for v in VARIANTS.values())
TMA_STAGES = (2, 3, 4)


def set_variant(name: str) -> None:
    for k, v in VARIANTS[name].items():
        setattr(ds, k, v)


def cfg_key(c: DecodeConfig) -> tuple:
    return (c.block_m, c.block_n, c.num_warps, c.num_stages, c.num_parts, c.fp8_prefetch, c.fp8_grouped)


def cfg_text(c: DecodeConfig) -> str:
    return (f"bm{c.block_m} bn{c.block_n} w{c.num_warps} st{c.num_stages}"
            f"{' pf' if c.fp8_prefetch else ''}{' grp' if c.fp8_grouped else ' deq'} parts{c.num_parts}")


def tma_settings(s_q: int) -> list[tuple[str, str, DecodeConfig]]:
    """``(label, variant, config)`` timed per case by ``--tma`` (module doc, item 3)."""
    base = shipped_config(s_q)
    out = [("ptr@default", "ptr", base)]
    out += [(f"tma@st{st}", "tma", base.with_(num_stages=st)) for st in TMA_STAGES]
    out.append(("tma-other@st3", "tma", base.with_(num_stages=3, fp8_grouped=not base.fp8_grouped)))
    return out


def f16_settings(s_q: int) -> list[tuple[str, str, DecodeConfig]]:
    """``(label, variant, config)`` timed per case by ``--f16`` (module doc, item 4): the
    baseline, then per load variant the fp16 and the bf16 dots side by side (so that a
    budget cut leaves pairs)."""
    base = shipped_config(s_q)
    grouped = base.with_(fp8_grouped=True)
    loads = [("st1pf", "ptr", grouped.with_(num_stages=1, fp8_prefetch=True)),
             ("st2", "ptr", grouped.with_(num_stages=2, fp8_prefetch=False)),
             ("st3", "ptr", grouped.with_(num_stages=3, fp8_prefetch=False))]
    if grouped.block_m <= ds.TMA_MAX_BLOCK_M:  # else fp8_tma_plan refuses: the pointer path again
        # (TMA reads num_stages=1 as FP8_TMA_STAGES, dropping the prefetch: st1pf would repeat st3)
        loads += [(f"st{st}", "tma", grouped.with_(num_stages=st, fp8_prefetch=False)) for st in (2, 3)]
    out = [("shipped@default", "shipped", base)]
    for name, loads_by, cfg in loads:
        for dots in ("f16", "bf16"):
            out.append((f"{dots}-{loads_by}@{name}", f"{dots}-{loads_by}", cfg))
    return out


PMEM_HEADS = 128


def pmem_settings(s_q: int) -> list[tuple[str, str, DecodeConfig]]:
    """``(label, variant, config)`` timed per case by ``--pmem`` (module doc, item 5), h=128:
    P through memory off / on at the former default (64-key tiles, 2 stages; the baseline,
    off) and at the shipped default (128-key tiles, 1 stage)."""
    base = shipped_config(s_q, PMEM_HEADS)
    old = base.with_(block_n=64, num_stages=2, min_tiles_per_part=2)
    return [("off@bn64st2", "pmem-off", old), ("on@bn64st2", "pmem-on", old),
            ("off@default", "pmem-off", base), ("on@default", "pmem-on", base)]


def tma_plan_record(cache, cfg: DecodeConfig, capability=None) -> dict:
    """What ``kernels.decode_split.fp8_tma_plan`` decides for this cache and config under the
    switches now set (the launcher makes the same call; ``capability``: as for a device of
    that compute capability, e.g. for ``--dry-run``)."""
    spec = ModelSpec()
    p = ds.fp8_tma_plan(cache, rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim, fp8_group=spec.fp8_group,
                        block_m=cfg.block_m, block_n=cfg.block_n, num_stages=cfg.num_stages, capability=capability)
    return dict(tma=p.use, tma_num_stages=p.num_stages if p.use else None, tma_reason=p.reason)


def make_cfg(rows: int, sms: int, bn: int, warps: int, stages: int, prefetch: bool) -> DecodeConfig:
    bm = 16 if rows <= 16 else 32
    m_blocks = -(-rows // bm)
    return DecodeConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, fp8_prefetch=prefetch,
                        num_parts=max(1, sms // m_blocks), min_tiles_per_part=2)


def shipped_config(s_q: int, heads: int = HEADS) -> DecodeConfig:
    return default_config(ModelSpec(num_heads=heads), s_q, torch.device("cuda"), fp8=True)


def sweep_plan(s_q: int, sms: int) -> list[tuple[str, DecodeConfig]]:
    """(variant, config) pairs swept for s_q, most promising first (the budget may cut the tail)."""
    rows = HEADS * s_q
    plan = [("dequant", shipped_config(s_q)), ("grouped", shipped_config(s_q))]
    for bn in (32, 64, 128):
        for warps in (8, 4):
            for stages in (2, 3, 1):
                plan.append(("grouped", make_cfg(rows, sms, bn, warps, stages, False)))
                if stages == 1:
                    plan.append(("grouped", make_cfg(rows, sms, bn, warps, 1, True)))
    for bn in (32, 64):
        for stages in (2, 3):
            plan.append(("grouped-single", make_cfg(rows, sms, bn, 8, stages, False)))
    for c in kb.candidate_configs(rows, sms, "fp8"):
        plan.append(("dequant", c))
    seen, out = set(), []
    for v, c in plan:
        if (v, cfg_key(c)) not in seen:
            seen.add((v, cfg_key(c)))
            out.append((v, c))
    return out


# --------------------------------------------------------------------------- precompile

def _warm_worker(jobs: list[tuple[str, int, dict, int]]) -> list[str]:
    """In a worker process: run one tiny case per (variant, s_q, config, heads) so that
    Triton compiles the kernels into its on-disk cache. Returns error lines."""
    try:
        spec = ModelSpec()
        pool = kb.CachePool(spec, 2048)
        gen = torch.Generator().manual_seed(0)
    except Exception as e:
        return [f"worker setup: {type(e).__name__}: {e}"[:300]]
    errors = []
    for variant, s_q, cfg, heads in jobs:
        set_variant(variant)
        try:
            kb.run_case(spec, pool, heads, s_q, 1, 1024, "fp8", DecodeConfig(**cfg), gen)
        except Exception as e:  # OutOfResources etc.: the timing pass reports it again
            errors.append(f"{variant} s_q={s_q} {cfg}: {type(e).__name__}: {e}"[:300])
    return errors


def finish(doc: dict, out: str | None, t_start: float) -> int:
    """Write ``doc`` as JSON to ``out`` (if given), print the wall time; exit status 0."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"# wall {time.time() - t_start:.0f} s", flush=True)
    return 0


def precompile_unique(items: list[tuple[str, int, DecodeConfig]], jobs: int, heads: int = HEADS) -> None:
    """``precompile`` each distinct (variant, s_q, config) once, reporting the time taken; a
    failure only costs time (the timing pass compiles whatever is missing)."""
    uniq = {(v, s_q, cfg_key(c)): (v, s_q, c) for v, s_q, c in items}
    t0 = time.time()
    try:
        precompile(list(uniq.values()), jobs, heads)
    except Exception as e:
        print(f"# precompile failed ({type(e).__name__}: {e}); compiling lazily", flush=True)
    print(f"# precompiled {len(uniq)} variants with {jobs} workers in {time.time() - t0:.0f} s", flush=True)


def precompile(items: list[tuple[str, int, DecodeConfig]], jobs: int, heads: int = HEADS) -> None:
    import concurrent.futures as cf
    import dataclasses
    import multiprocessing as mp
    payload = [(v, s_q, dataclasses.asdict(c), heads) for v, s_q, c in items]
    chunks = [payload[i::jobs] for i in range(jobs)]
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        for errs in ex.map(_warm_worker, [c for c in chunks if c]):
            for e in errs:
                print(f"# precompile: {e}", flush=True)


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--sq", default="1,2")
    ap.add_argument("--batch", default="32,128")
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--sweep-case", default="128,4096", help="B,L of the sweep case")
    ap.add_argument("--no-sweep", action="store_true", help="grid at the shipped default configs only")
    ap.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="precompile worker processes (0: compile lazily in this process)")
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop starting measurements after this")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--tma", action="store_true", help="TMA path vs pointer path at the default configs only")
    mode.add_argument("--f16", action="store_true", help="fp16 vs bf16 dots of the grouped path (module doc, item 4)")
    mode.add_argument("--pmem", action="store_true", help="P through memory off / on at h=128 (module doc, item 5)")
    ap.add_argument("--dry-run", action="store_true", help="print the planned settings and exit (no GPU needed)")
    args = ap.parse_args(argv)
    sqs = [int(x) for x in args.sq.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    lens = [int(x) for x in args.lens.split(",")]
    sweep_B, sweep_L = (int(x) for x in args.sweep_case.split(","))
    if args.dry_run:
        return dry_run(args, sqs, batches, lens)
    if not torch.cuda.is_available():
        print("fp8_decode_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    if args.tma or args.f16 or args.pmem:
        return grid_main(args, t_start, sqs, batches, lens, props, sms, **MODES[_mode(args)])

    plans = {s_q: ([] if args.no_sweep else sweep_plan(s_q, sms)) for s_q in sqs}
    if args.jobs > 0:
        items = [(v, s_q, c) for s_q in sqs for v, c in plans[s_q]]
        items += [(v, s_q, shipped_config(s_q)) for s_q in sqs for v in ("dequant", "grouped")]
        precompile_unique(items, args.jobs)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    copy_tbps = kb.measure_copy_tbps()
    print(f"# {props.name} ({sms} SMs): copy {copy_tbps:.2f} TB/s (read+write); h={HEADS}, DeepSeek-V3 dims, FP8",
          flush=True)
    spec = ModelSpec()
    pool = kb.CachePool(spec, max(batches + [sweep_B]) * max(lens + [sweep_L]))
    skipped = 0

    def measure(variant, s_q, B, L, cfg):
        nonlocal skipped
        if time.time() - t_start > args.budget_s:
            skipped += 1
            return None
        set_variant(variant)
        try:
            t_ms, io, _ = kb.run_case(spec, pool, HEADS, s_q, B, L, "fp8", cfg, gen)
        except Exception as e:  # e.g. OutOfResources: this config does not fit
            print(f"  {variant:14s} {cfg_text(cfg)}: {type(e).__name__}: {e}"[:300], flush=True)
            return math.inf
        return dict(variant=variant, s_q=s_q, B=B, L=L, config=kb.cfg_dict(cfg), time_us=t_ms * 1e3,
                    TBps=io / (t_ms * 1e-3) / 1e12, bw_ratio=io / (t_ms * 1e-3) / 1e12 / copy_tbps)

    # 1. sweep
    sweep_rows, best = [], {}
    for s_q in sqs:
        if not plans[s_q]:
            continue
        print(f"\n## sweep s_q={s_q} B={sweep_B} L={sweep_L}", flush=True)
        print(f"  {'variant':14s} {'config':34s} {'time us':>9s} {'TB/s':>6s} {'of copy':>7s}", flush=True)
        for variant, cfg in plans[s_q]:
            r = measure(variant, s_q, sweep_B, sweep_L, cfg)
            if not isinstance(r, dict):
                continue
            sweep_rows.append(r)
            print(f"  {variant:14s} {cfg_text(cfg):34s} {r['time_us']:9.1f} {r['TBps']:6.2f} {r['bw_ratio']:7.0%}",
                  flush=True)
            fam = "dequant" if variant == "dequant" else "grouped"  # grouped-single competes with grouped
            if (fam, s_q) not in best or r["time_us"] < best[(fam, s_q)][2]:
                best[(fam, s_q)] = (variant, cfg, r["time_us"])

    # 2. grid
    results = []
    print("\n## grid (speedup vs dequant at the shipped default config)", flush=True)
    print(f"  {'s_q':>3s} {'B':>4s} {'L':>6s}  {'setting':30s} {'config':34s} {'time us':>9s} {'TB/s':>6s} "
          f"{'of copy':>7s} {'speedup':>7s}", flush=True)
    for s_q in sqs:
        settings = [("dequant@default", "dequant", shipped_config(s_q)),
                    ("grouped@default", "grouped", shipped_config(s_q))]
        for fam in ("dequant", "grouped"):
            if (fam, s_q) in best:
                variant, cfg, _ = best[(fam, s_q)]
                settings.append((f"{variant}@swept", variant, cfg))
        for B in batches:
            for L in lens:
                base = None
                for label, variant, cfg in settings:
                    r = measure(variant, s_q, B, L, cfg)
                    if not isinstance(r, dict):
                        continue
                    r["setting"] = label
                    base = r["time_us"] if label == "dequant@default" else base
                    r["speedup_vs_dequant_default"] = base / r["time_us"] if base else None
                    results.append(r)
                    sp = f"{r['speedup_vs_dequant_default']:6.2f}x" if base else "      -"
                    print(f"  {s_q:3d} {B:4d} {L:6d}  {label:30s} {cfg_text(cfg):34s} {r['time_us']:9.1f} "
                          f"{r['TBps']:6.2f} {r['bw_ratio']:7.0%} {sp}", flush=True)
    if skipped:
        print(f"# budget of {args.budget_s:.0f} s reached: {skipped} measurements skipped", flush=True)

    summary = {f"{fam}/sq{s_q}": dict(variant=v, config=kb.cfg_dict(c), sweep_time_us=t)
               for (fam, s_q), (v, c, t) in best.items()}
    print("# best " + json.dumps(summary), flush=True)
    doc = {
        "gpu": props.name, "sms": sms, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": __import__("triton").__version__, "python": platform.python_version(),
        "copy_TBps_read_plus_write": copy_tbps, "heads": HEADS, "sweep_case": [sweep_B, sweep_L],
        "timing": kb.TIMING_NOTE,
        "variants": VARIANTS, "best": summary, "sweep": sweep_rows, "results": results,
        "skipped_for_budget": skipped, "wall_s": time.time() - t_start,
    }
    return finish(doc, args.out, t_start)


#: the settings-grid modes: per s_q a list of (label, variant, config) timed on every case,
#: the label whose time is the baseline, the title of the table, the variants recorded
MODES = {
    "tma": dict(mode="tma", settings=tma_settings, baseline="ptr@default", title="TMA vs pointer loads",
                variants=("ptr", "tma"), heads=HEADS),
    "f16": dict(mode="f16", settings=f16_settings, baseline="shipped@default",
                title="fp16 vs bf16 dots of the grouped path", variants=("shipped", "f16-ptr", "bf16-ptr", "f16-tma",
                                                                          "bf16-tma"), heads=HEADS),
    "pmem": dict(mode="pmem", settings=pmem_settings, baseline="off@bn64st2",
                 title="P through memory (h=128, dequantise path)", variants=("pmem-off", "pmem-on"),
                 heads=PMEM_HEADS),
}


def _mode(args) -> str:
    return "tma" if args.tma else "f16" if args.f16 else "pmem"


def _speedup_key(baseline: str) -> str:
    return "speedup_vs_" + baseline.replace("@", "_")  # ptr@default -> speedup_vs_ptr_default


def dry_run(args, sqs, batches, lens) -> int:
    """``--dry-run``: the settings each mode would time, without a GPU (the TMA decision is
    the one a device of compute capability 9.0 would get; the sweep assumes 132 SMs)."""
    spec = ModelSpec()
    cache = torch.zeros(2, kb.PAGE, spec.fp8_bytes_per_token, dtype=torch.uint8)
    cases = [(B, L) for B in batches for L in lens]
    if args.tma or args.f16 or args.pmem:
        m = MODES[_mode(args)]
        print(f"# --{m['mode']}: {m['title']}; baseline {m['baseline']}; {len(cases)} cases per s_q {cases}")
        total = 0
        for s_q in sqs:
            settings = m["settings"](s_q)
            total += len(settings) * len(cases)
            print(f"## s_q={s_q}: {len(settings)} settings")
            for label, variant, cfg in settings:
                set_variant(variant)
                plan = tma_plan_record(cache, cfg, capability=(9, 0))
                grouped = ds.fp8_grouped_dots(spec.kv_lora_rank, spec.fp8_group, cfg.block_m) and cfg.fp8_grouped
                tma_txt = f"st{plan['tma_num_stages']}" if plan["tma"] else "no"
                p_mem = ds.fp8_p_via_memory(True, grouped, cfg.block_m)
                print(f"  {label:18s} {cfg_text(cfg):38s} TMA {tma_txt:4s} grouped={grouped!s:5s} "
                      f"fp16_dots={grouped and bool(ds.FP8_FP16_DOTS)!s:5s} p_mem={p_mem!s:5s} {VARIANTS[variant]}")
        print(f"# {total} measurements")
    else:
        for s_q in sqs:
            plan = [] if args.no_sweep else sweep_plan(s_q, 132)
            print(f"## s_q={s_q}: sweep of {len(plan)} configs, then the grid {cases}")
            for variant, cfg in plan:
                print(f"  {variant:14s} {cfg_text(cfg)}")
    set_variant("shipped")
    return 0


def grid_main(args, t_start, sqs, batches, lens, props, sms, *, mode, settings, baseline, title, variants,
              heads) -> int:
    """``--tma`` / ``--f16`` / ``--pmem`` (module doc, items 3-5): every setting
    ``settings(s_q)`` on every case of the grid (``heads`` query heads), with the speedup over
    the ``baseline`` setting."""
    settings = {s_q: settings(s_q) for s_q in sqs}
    if args.jobs > 0:
        precompile_unique([(v, s_q, c) for s_q in sqs for _, v, c in settings[s_q]], args.jobs, heads)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    copy_tbps = kb.measure_copy_tbps()
    print(f"# {props.name} ({sms} SMs, cc {props.major}.{props.minor}): copy {copy_tbps:.2f} TB/s "
          f"(read+write); h={heads}, DeepSeek-V3 dims, FP8, page {kb.PAGE}", flush=True)
    spec = ModelSpec()
    pool = kb.CachePool(spec, max(batches) * max(lens))
    cache = pool.get("fp8")
    speedup = _speedup_key(baseline)
    width = max(len(lab) for s_q in sqs for lab, _, _ in settings[s_q])
    results, skipped = [], 0
    print(f"\n## {title} (speedup vs {baseline})", flush=True)
    print(f"  {'s_q':>3s} {'B':>4s} {'L':>6s}  {'setting':{width}s} {'config':38s} {'TMA':>5s} {'time us':>9s} "
          f"{'TB/s':>6s} {'of copy':>7s} {'speedup':>7s}", flush=True)
    for s_q in sqs:
        for B in batches:
            for L in lens:
                base = None
                for label, variant, cfg in settings[s_q]:
                    if time.time() - t_start > args.budget_s:
                        skipped += 1
                        continue
                    set_variant(variant)
                    plan = tma_plan_record(cache, cfg)
                    grouped = cfg.fp8_grouped and ds.fp8_grouped_dots(spec.kv_lora_rank, spec.fp8_group, cfg.block_m)
                    fields = dict(setting=label, variant=variant, s_q=s_q, B=B, L=L, config=kb.cfg_dict(cfg),
                                  fp8_grouped=cfg.fp8_grouped, p_mem=ds.fp8_p_via_memory(True, grouped, cfg.block_m),
                                  **plan)
                    try:
                        t_ms, io, flops = kb.run_case(spec, pool, heads, s_q, B, L, "fp8", cfg, gen)
                    except Exception as e:  # e.g. OutOfResources: this config does not fit
                        err = f"{type(e).__name__}: {e}"
                        print(f"  {s_q:3d} {B:4d} {L:6d}  {label:{width}s} {cfg_text(cfg)}: {err}"[:300], flush=True)
                        results.append(dict(fields, error=err[:300]))
                        continue
                    tbps = io / (t_ms * 1e-3) / 1e12
                    r = dict(fields, time_us=t_ms * 1e3, TBps=tbps, bw_ratio=tbps / copy_tbps,
                             TFLOPs=flops / (t_ms * 1e-3) / 1e12)
                    if label == baseline:
                        base = r["time_us"]
                    r[speedup] = base / r["time_us"] if base else None
                    results.append(r)
                    sp = f"{r[speedup]:6.2f}x" if base else "      -"
                    tma_txt = f"st{plan['tma_num_stages']}" if plan["tma"] else "no"
                    print(f"  {s_q:3d} {B:4d} {L:6d}  {label:{width}s} {cfg_text(cfg):38s} {tma_txt:>5s} "
                          f"{r['time_us']:9.1f} {tbps:6.2f} {r['bw_ratio']:7.0%} {sp}", flush=True)
    set_variant("shipped")
    if skipped:
        print(f"# budget of {args.budget_s:.0f} s reached: {skipped} measurements skipped", flush=True)
    doc = {
        "gpu": props.name, "sms": sms, "capability": [props.major, props.minor],
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "python": platform.python_version(),
        "copy_TBps_read_plus_write": copy_tbps, "heads": heads, "page_size": kb.PAGE, "mode": mode,
        "timing": kb.TIMING_NOTE,
        "variants": {k: VARIANTS[k] for k in variants}, "baseline": baseline,
        "tma_module": {k: getattr(ds, k) for k in ("FP8_TMA_STAGES", "FP8_TMA_SMEM_BUDGET", "TMA_MAX_BLOCK_M")},
        "settings": {s_q: [dict(setting=lab, variant=v, config=kb.cfg_dict(c), fp8_grouped=c.fp8_grouped)
                           for lab, v, c in settings[s_q]] for s_q in sqs},
        "results": results, "skipped_for_budget": skipped, "wall_s": time.time() - t_start,
    }
    return finish(doc, args.out, t_start)


if __name__ == "__main__":
    sys.exit(main())
