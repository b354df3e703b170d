"""Summarise the matrices of ``ci/gpu_detection.sh`` (one ``PHASE.json`` + ``PHASE.txt`` per
phase, in one or more folders) into one JSON of the ``mla-fuzz-gpu-detection/1`` format that
``benchmarks/results/h200-*-detection*.json`` use: per phase the rows caught and named right,
the median and slowest first finding (seconds from the command's start), the examples to
detect, the first row's start, the warmup, out-of-memory notices, the zygote's import time,
the clean row, and every row.

    python3 benchmarks/gpu_detection_summary.py --out FILE --machine TEXT --command TEXT \
        --tree TEXT [--note TEXT ...] LABEL=DIR [LABEL=DIR ...]

A phase ``P`` of folder ``LABEL=DIR`` is named ``LABEL/P`` (``LABEL`` empty: ``P``).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

FORMAT = "mla-fuzz-gpu-detection/1"
_ZYGOTE = re.compile(r"imported torch.* once in ([0-9.]+)s")
_WORKERS = re.compile(r"\] ([0-9.]+)s: workers: ")


def summarise(matrix: dict, log: str) -> dict:
    """One phase: ``matrix`` is the ``mutants --json`` document, ``log`` its stderr/stdout text."""
    rows = matrix["rows"]
    mutants = [r for r in rows if r["backend"] != "triton"]
    caught = [r for r in mutants if r["caught"]]
    seconds = [r["seconds_to_detect"] for r in caught if r["seconds_to_detect"] is not None]
    examples = [r["examples_to_detect"] for r in caught if r["examples_to_detect"] is not None]
    clean = next((r for r in rows if r["backend"] == "triton"), None)
    zygote = _ZYGOTE.search(log)
    workers = _WORKERS.search(log)
    return {
        "rows": len(mutants), "rows_caught": len(caught), "named_right": sum(1 for r in caught if r["matches"]),
        "median_seconds_to_detect": round(statistics.median(seconds), 1) if seconds else None,
        "max_seconds_to_detect": max(seconds) if seconds else None,
        "rows_within_30s": sum(1 for s in seconds if s <= 30), "rows_within_60s": sum(1 for s in seconds if s <= 60),
        "median_examples_to_detect": statistics.median(examples) if examples else None,
        "examples_to_detect_summed": sum(examples),
        "first_row_started_s": min((r["row_started_s"] for r in rows if r["row_started_s"] is not None), default=None),
        "wall_s": matrix.get("wall_s"), "warmup_s": matrix.get("warmup_s"),
        "oom_notices": log.count("ran out of GPU memory"),
        "zygote_imports_s": float(zygote.group(1)) if zygote else None,
        # when the command had its workers forked (MPS daemons started first, where asked)
        "workers_forked_s": float(workers.group(1)) if workers else None,
        # workers (and the command) forked from a running `mla-fuzz server`: its imports were
        # paid before the command started and are not in these seconds
        "in_server": "forked from the mla-fuzz server" in log,
        "clean_triton": None if clean is None else {k: clean.get(k) for k in
                                                    ("caught", "examples", "diagnosis", "oracle", "message",
                                                     "oom_retries")},
        "escaped": [r["name"] for r in mutants if not r["caught"]],
        "misnamed": [[r["name"], r["diagnosis"]] for r in caught if r["matches"] is False],
        "per_row": [{k: r.get(k) for k in ("name", "caught", "examples_to_detect", "seconds_to_detect",
                                           "row_started_s", "diagnosis", "matches", "oom_retries", "mps_rerun")}
                    for r in rows],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--tree", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("dirs", nargs="+", metavar="LABEL=DIR")
    args = ap.parse_args(argv)
    phases = {}
    for item in args.dirs:
        label, sep, folder = item.partition("=")
        if not sep or not Path(folder).is_dir():
            print(f"gpu_detection_summary: expected LABEL=DIR with DIR a folder, got {item!r}", file=sys.stderr)
            return 2
        for js in sorted(Path(folder).glob("*.json")):
            log = js.with_suffix(".txt")
            name = f"{label}/{js.stem}" if label else js.stem
            phases[name] = summarise(json.loads(js.read_text()), log.read_text() if log.exists() else "")
    if not phases:
        print("gpu_detection_summary: no PHASE.json found in the folders given", file=sys.stderr)
        return 2
    doc = {"format": FORMAT, "machine": args.machine, "date": time.strftime("%Y-%m-%d"), "command": args.command,
           "tree": args.tree, "notes": args.note, "phases": phases}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {', '.join(phases)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
