"""Where a worker's seconds go before its first finding (issue #44), N workers at once.

The parent imports what the zygote and the server preload (``zygote._preload``), never
touching CUDA, then forks ``N`` children together, as the server forks a command's workers.
Each child, with one GPU worker's environment (``worker_envs``; ``--mps``: connected to a
private MPS daemon as ``mutants --mps`` does), times from its fork:

- ``harness_s``: importing the harness a worker imports (``harness.fuzz``, ``harness.worker``);
- ``backend_s``: loading the backend (``--backend``, default a mutant found in one example);
- ``cuda_s``: its CUDA context (a one-element tensor, synchronised);
- ``found_s``: the first failure seen by ``fuzz(examples=1)`` (``on_found``), as a worker's
  first row; ``done_s`` when that call returns (shrinking off, diagnosis on).

``--profile`` also runs child 0 under cProfile and keeps the 30 functions with the most
cumulative time. Writes JSON (``--out``) with the machine and versions.

    python3 benchmarks/first_example.py --procs 1,16 --mps --profile --out /tmp/first.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
FORMAT = "mla-fuzz-first-example/1"


def _child(wfd: int, env: dict, backend: str, spec: str, graph: str, profile: bool) -> None:
    t0 = time.monotonic()
    os.environ.update(env)
    if env.get("MLA_FUZZ_CUDA_EARLY") == "1":  # as harness.worker does (MLA_FUZZ_CUDA_EARLY=1 in the caller's env)
        from mla_fuzz.harness.cuda_early import open_primary_context
        open_primary_context()
    out: dict = {}
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    try:
        from mla_fuzz.harness import fuzz as fuzz_mod, worker  # noqa: F401
        out["harness_s"] = time.monotonic() - t0
        from mla_fuzz.harness.loading import load_backend
        load_backend(backend)
        out["backend_s"] = time.monotonic() - t0
        if graph == "cuda":
            import torch
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            out["cuda_s"] = time.monotonic() - t0

        def found(repro, info):
            out["found_s"] = time.monotonic() - t0
            out["examples"] = info.get("examples_to_detect")
        fuzz_mod.fuzz(backend, spec=spec, graph_mode=graph, examples=1, seed=0, shrink=False, on_found=found)
        out["done_s"] = time.monotonic() - t0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
    if prof is not None:
        import io
        import pstats
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        out["profile"] = buf.getvalue().splitlines()
    os.write(wfd, (json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()})
                   + "\n").encode())
    os._exit(0)


def measure(n: int, backend: str, spec: str, graph: str, mps, profile: bool) -> dict:
    from mla_fuzz.harness.worker_env import worker_envs

    # the GPU count given, not asked: asking CUDA here would make every fork unusable
    envs = worker_envs(n, graph, device_count=1 if graph == "cuda" else 0)
    if mps is not None:
        envs = [mps.client_env(e) for e in envs]
    pids = []
    reads = []
    t0 = time.monotonic()
    for i, env in enumerate(envs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(w, env, backend, spec, graph, profile and i == 0)
        os.close(w)
        pids.append(pid)
        reads.append(r)
    rows = []
    for pid, r in zip(pids, reads):
        with os.fdopen(r) as fh:
            text = fh.read().strip()
        os.waitpid(pid, 0)
        rows.append(json.loads(text) if text else {"error": "no result"})
    wall = time.monotonic() - t0

    def med(key):
        vals = [x[key] for x in rows if key in x]
        return round(statistics.median(vals), 3) if vals else None
    return {"procs": n, "wall_s": round(wall, 3), **{f"median_{k}": med(k) for k in
                                                       ("harness_s", "backend_s", "cuda_s", "found_s", "done_s")},
            "rows": rows}


def main(argv=None) -> int:
    from detection import machine, versions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--procs", default="1,16", help="concurrent children, comma-separated (default 1,16)")
    ap.add_argument("--backend", default="mutant:item-in-capture")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--graph", default="cuda", help="cuda (default) or emulated (a CPU check of the script)")
    ap.add_argument("--mps", action="store_true", help="children share a private MPS daemon, as mutants --mps")
    ap.add_argument("--profile", action="store_true", help="cProfile child 0 of each measurement")
    args = ap.parse_args(argv)
    from mla_fuzz.harness import zygote
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # as the zygote: NVML answers, CUDA stays untouched
    preload_s = zygote._preload()
    doc = {"format": FORMAT, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["benchmarks/first_example.py", *(sys.argv[1:] if argv is None else argv)]),
           "preload_s": round(preload_s, 3),
           "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"), "runs": []}
    mps = None
    if args.mps:
        from mla_fuzz.harness.mps import MpsDaemon
        mps = MpsDaemon().start()
    try:
        for n in (int(x) for x in args.procs.split(",")):
            run = measure(n, args.backend, args.spec, args.graph, mps, args.profile)
            doc["runs"].append(run)
            print(f"{n} at once: harness {run['median_harness_s']}s, backend {run['median_backend_s']}s, CUDA "
                  f"{run['median_cuda_s']}s, first finding {run['median_found_s']}s, done {run['median_done_s']}s "
                  f"(medians from fork), wall {run['wall_s']}s", flush=True)
            errs = [r["error"] for r in run["rows"] if "error" in r]
            if errs:
                print("  errors: " + errs[0], flush=True)
    finally:
        if mps is not None:
            mps.stop()
    doc["machine"], doc["versions"] = machine(), versions()  # after the forks: this may start CUDA here
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
