"""Where a command's first seconds go, before its first finding (issue #44): fresh processes.

Three measurements, each in new processes as a user's command starts them:

- ``imports``: one process importing torch, then the harness a worker imports, then triton,
  then (on a GPU) creating the CUDA context; seconds for each, from the process start;
- ``pool``: ``--workers`` lists pool sizes; for each, the seconds from starting that many worker
  processes (``harness.pool``, as ``run`` and ``mutants`` do) until all say ready;
- ``scenarios``: one process runs the first ``--scenarios`` scenarios of the clean backend's
  warmup list (``harness.warmup``) one after another and times each; on a GPU it also counts
  the Triton kernel variants each one had to load or compile (``JITFunction._do_compile``
  calls: a disk-cache hit still passes there) and their seconds. Run it twice on one
  ``TRITON_CACHE_DIR`` to see a warm cache's cost per process.

Writes JSON (``--out``) with the machine and versions (``benchmarks/detection.py``'s).

    python3 benchmarks/startup.py --workers 1,4,16 --scenarios 8 --out /tmp/startup.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
FORMAT = "mla-fuzz-startup-bench/1"

_IMPORTS = r"""
import json, time
t0 = time.monotonic()
out = {}
import torch
out["torch_s"] = time.monotonic() - t0
import mla_fuzz.harness.fuzz, mla_fuzz.harness.executor
out["harness_s"] = time.monotonic() - t0
import triton
out["triton_s"] = time.monotonic() - t0
out["cuda_s"] = None
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out["cuda_s"] = time.monotonic() - t0
print(json.dumps(out))
"""

_SCENARIOS = r"""
import json, sys, time
t0 = time.monotonic()
import torch
from mla_fuzz.harness import warmup
from mla_fuzz.harness.executor import ScenarioRunner, StepUnsupported
from mla_fuzz.harness.fuzz import resolve_mode
from mla_fuzz.harness.loading import load_backend
from mla_fuzz.harness.oracles import OracleFailure
from mla_fuzz.harness.scenario import ScenarioConfig
loads = []
try:
    from triton.runtime.jit import JITFunction
    _orig = JITFunction._do_compile
    def _timed(self, *a, **k):
        s = time.monotonic()
        try:
            return _orig(self, *a, **k)
        finally:
            loads.append(time.monotonic() - s)
    JITFunction._do_compile = _timed
except (ImportError, AttributeError):
    pass
spec, count, graph = sys.argv[1], int(sys.argv[2]), sys.argv[3]
mode = resolve_mode(graph)
plan = warmup.prepare("triton", [spec], mode, gpu=mode == "cuda", force=True)
cls = load_backend("triton")
ready = time.monotonic() - t0
rows = []
for sc in plan.specs[0].scenarios[:count]:
    s, n = time.monotonic(), len(loads)
    status = "ok"
    runner = None
    try:
        runner = ScenarioRunner(cls, ScenarioConfig.from_dict(sc.config), mode)
        for step in sc.steps:
            runner.apply(step)
    except OracleFailure as f:
        status = "failed: " + f.oracle
    except StepUnsupported:
        status = "unsupported"
    finally:
        if runner is not None:
            runner.close()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rows.append({"name": sc.name, "seconds": round(time.monotonic() - s, 3), "kernel_loads": len(loads) - n,
                 "kernel_load_s": round(sum(loads[n:]), 3), "status": status})
print(json.dumps({"imports_s": round(ready, 3), "scenarios": rows, "kernel_loads": len(loads),
                  "kernel_load_s": round(sum(loads), 3), "total_s": round(time.monotonic() - t0, 3)}))
"""


def _python(code: str, args: list[str], env: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pool_ready(n: int, graph: str, timeout: float) -> dict:
    """Seconds from starting ``n`` workers to each one's ready message (the last is the pool's)."""
    from mla_fuzz.harness.worker_env import worker_envs
    from mla_fuzz.harness.pool import Pool

    with tempfile.TemporaryDirectory(prefix="mla-fuzz-startup-") as logs:
        t0 = time.monotonic()
        pool = Pool(worker_envs(n, graph), logs)
        pool.start()
        ready: list[float] = []
        try:
            while len(ready) < n:
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"{n - len(ready)} of {n} workers not ready after {timeout:g} s")
                for ev in pool.poll(0.1):
                    if ev.kind == "fatal":
                        raise RuntimeError(f"a worker could not start: {ev.msg.get('error')}")
                    if ev.kind == "ready":
                        ready.append(round(time.monotonic() - t0, 3))
        finally:
            pool.close(kill=True)
    return {"workers": n, "first_ready_s": ready[0], "all_ready_s": ready[-1], "ready_s": ready}


def main(argv=None) -> int:
    from detection import machine, versions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--graph", default="auto", help="graph mode of the workers and scenarios (default auto)")
    ap.add_argument("--spec", default="tiny", help="the warmup list's spec (default tiny)")
    ap.add_argument("--workers", default="1,4", help="pool sizes to time, comma-separated (default 1,4)")
    ap.add_argument("--scenarios", type=int, default=6, help="warmup scenarios to time in one process (default 6)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each measurement may take")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--workers: expected comma-separated whole numbers, got {args.workers!r}")
    if not sizes or min(sizes) < 1 or args.scenarios < 1:
        ap.error("--workers and --scenarios must be at least 1")
    from mla_fuzz.harness.fuzz import resolve_mode
    graph = resolve_mode(args.graph)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if graph != "cuda":
        env.setdefault("TRITON_INTERPRET", "1")
    doc = {"format": FORMAT, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["benchmarks/startup.py", *(sys.argv[1:] if argv is None else argv)]),
           "settings": {"graph": graph, "spec": args.spec, "workers": sizes, "scenarios": args.scenarios,
                        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")},
           "machine": machine(), "versions": versions()}
    doc["imports"] = _python(_IMPORTS, [], env, args.timeout)
    print(f"imports: torch {doc['imports']['torch_s']:.2f}s, harness {doc['imports']['harness_s']:.2f}s, "
          f"triton {doc['imports']['triton_s']:.2f}s" + ("" if doc["imports"]["cuda_s"] is None
                                                          else f", CUDA context {doc['imports']['cuda_s']:.2f}s"),
          flush=True)
    doc["pool"] = []
    for n in sizes:
        doc["pool"].append(pool_ready(n, graph, args.timeout))
        p = doc["pool"][-1]
        print(f"pool of {n}: first ready {p['first_ready_s']:.2f}s, all ready {p['all_ready_s']:.2f}s", flush=True)
    doc["scenarios"] = _python(_SCENARIOS, [args.spec, str(args.scenarios), graph], env, args.timeout)
    s = doc["scenarios"]
    print(f"scenarios in one process: imports {s['imports_s']:.2f}s, then "
          + ", ".join(f"{r['seconds']:.2f}s" for r in s["scenarios"])
          + f"; {s['kernel_loads']} kernel loads in {s['kernel_load_s']:.2f}s", flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
