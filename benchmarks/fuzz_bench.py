"""Fuzzer throughput: cases/s of ``mla-fuzz run`` campaigns against the targets.

A thin wrapper around ``mla-fuzz bench`` (``harness/throughput.py`` holds the logic and the
run layout): GPU runs put ``per-gpu`` worker processes on each of ``gpus`` GPUs; CPU runs
(emulated) use ``workers`` processes; each (spec, mode) starts with an untimed warm-up
that fills Triton's kernel cache. Writes JSON (``--out``) and prints a table and the
headline figures (one GPU >= 50 cases/s tiny cuda; 1 -> N GPU scaling >= 0.85; emulated
>= 2 cases/s per core).

    python benchmarks/fuzz_bench.py --out benchmarks/results/<gpu>-<date>-fuzz-bench.json
    python benchmarks/fuzz_bench.py --specs tiny --modes cuda --gpus 1,2 --per-gpu 1,8 --out /tmp/fb.json
    python benchmarks/fuzz_bench.py --specs tiny --modes emulated --workers 1,2 --budget 60 --out /tmp/fb.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mla_fuzz.harness.cli import main as cli_main  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--specs", default="tiny,deepseek-v3")
    ap.add_argument("--modes", default="auto", help="comma-separated graph modes (auto, cuda, emulated, eager)")
    ap.add_argument("--gpus", default=None, help="cuda: GPU counts (default 1 and all)")
    ap.add_argument("--per-gpu", default="1,8", help="cuda: worker processes per GPU")
    ap.add_argument("--workers", default="1,auto", help="CPU modes: worker counts (N or auto)")
    ap.add_argument("--budget", default="30", help="seconds per timed run")
    ap.add_argument("--warmup", default="30", help="seconds of untimed warm-up per spec and mode (0: none)")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--chunk", default="100")
    ap.add_argument("--case-timeout", default="300")
    ap.add_argument("--mps", action="store_true", help="cuda: workers under a private CUDA MPS daemon")
    args = ap.parse_args(argv)
    cmd = ["bench", "--backend", args.backend, "--spec", args.specs, "--graph", args.modes,
           "--per-gpu", args.per_gpu, "--workers", args.workers, "--budget", args.budget, "--warmup", args.warmup,
           "--seed", args.seed, "--chunk", args.chunk, "--case-timeout", args.case_timeout, "--json", args.out]
    if args.gpus:
        cmd += ["--gpus", args.gpus]
    if args.mps:
        cmd.append("--mps")
    return cli_main(cmd)


if __name__ == "__main__":
    sys.exit(main())
