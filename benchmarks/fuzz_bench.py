"""Fuzzer throughput: cases/s of ``mla-fuzz run`` campaigns.

One time-bounded campaign per (spec, graph mode, workers) in

    spec in {tiny, deepseek-v3} x mode in {cuda, emulated} x workers in {1, auto}

against the clean Triton backend (``--backend`` to change), each through the same
machinery as ``mla-fuzz run`` (worker processes, chunks, merging). ``cuda`` is skipped
without a GPU; ``emulated`` runs on the CPU through Triton's interpreter even on a GPU
box (``auto`` workers = one per core there, one per GPU under ``cuda``).

Per run it records cases (examples) and steps, the wall time, the start-up time until
the first worker was ready (importing torch in each worker), ``cases_per_s`` over the
whole run and ``cases_per_s_steady`` over the time after start-up, and any failure found
(the clean backend should have none). Writes JSON (``--out``) and prints a table.

    python benchmarks/fuzz_bench.py --out benchmarks/results/fuzz_bench.json
    python benchmarks/fuzz_bench.py --specs tiny --modes emulated --workers 1,2 --budget 30 --out /tmp/fb.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from harness.campaign import CampaignOptions, CampaignRun, worker_envs  # noqa: E402


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run_one(backend: str, spec: str, mode: str, workers: str, budget_s: float, seed: int, chunk: int,
            case_timeout: float) -> dict:
    """One campaign; a dict with its throughput (see the module docstring)."""
    envs = worker_envs(workers if workers == "auto" else int(workers), mode)
    with tempfile.TemporaryDirectory(prefix="mla-fuzz-bench-") as corpus:
        opts = CampaignOptions(backend=backend, graph=mode, spec=spec, budget_s=budget_s, examples=None, seed=seed,
                               corpus=corpus, worker_envs=envs, case_timeout=case_timeout, chunk=chunk)
        res = CampaignRun(opts).run(handle_sigint=False)
    steady = None
    if res.startup_s is not None and res.elapsed > res.startup_s:
        steady = res.examples / (res.elapsed - res.startup_s)
    return {
        "spec": spec, "mode": mode, "workers": len(envs), "workers_arg": workers,
        "examples": res.examples, "steps": res.steps, "chunks": res.chunks,
        "elapsed_s": round(res.elapsed, 3), "startup_s": None if res.startup_s is None else round(res.startup_s, 3),
        "cases_per_s": round(res.rate, 4), "cases_per_s_steady": None if steady is None else round(steady, 4),
        "steps_per_s": round(res.steps / res.elapsed, 4) if res.elapsed else None,
        "failures": [f.to_dict() for f in res.findings.values()], "errors": res.errors,
        "restarts": res.restarts,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--specs", default="tiny,deepseek-v3")
    ap.add_argument("--modes", default="cuda,emulated")
    ap.add_argument("--workers", default="1,auto", help="comma-separated worker counts (N or auto)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per campaign (start-up included)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=25)
    ap.add_argument("--case-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    runs = []
    print(f"{'spec':<12} {'mode':<9} {'workers':>7} {'cases':>7} {'steps':>7} {'wall s':>7} {'start s':>7} "
          f"{'cases/s':>8} {'steady':>8}  failures", flush=True)
    for spec in _list(args.specs):
        for mode in _list(args.modes):
            for workers in _list(args.workers):
                if mode == "cuda" and not cuda:
                    runs.append({"spec": spec, "mode": mode, "workers_arg": workers, "skipped": "no CUDA device"})
                    print(f"{spec:<12} {mode:<9} {workers:>7}  skipped: no CUDA device", flush=True)
                    continue
                r = run_one(args.backend, spec, mode, workers, args.budget, args.seed, args.chunk, args.case_timeout)
                runs.append(r)
                steady = "-" if r["cases_per_s_steady"] is None else f"{r['cases_per_s_steady']:.3f}"
                print(f"{spec:<12} {mode:<9} {r['workers']:>7} {r['examples']:>7} {r['steps']:>7} "
                      f"{r['elapsed_s']:>7.1f} {r['startup_s'] or 0:>7.1f} {r['cases_per_s']:>8.3f} {steady:>8}  "
                      f"{len(r['failures'])}" + (f"  errors: {r['errors']}" if r["errors"] else ""), flush=True)
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    doc = {
        "format": "mla-fuzz-fuzz-bench/1",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {"torch": torch.__version__, "triton": triton_version,
                     "device": torch.cuda.get_device_name() if cuda else "cpu",
                     "gpus": torch.cuda.device_count() if cuda else 0},
        "backend": args.backend, "budget_s": args.budget, "seed": args.seed, "chunk": args.chunk, "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
