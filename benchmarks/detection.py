"""Time to the first finding: how soon ``mla-fuzz`` tells the user about a bug, cold and warm.

For each mutant (``--only``; default every mutant of ``harness.mutants.ALL`` the graph mode
can see) it runs ``mla-fuzz mutants --only NAME --no-clean`` as its own command, as a user
would after a change, twice:

- ``cold``: ``TRITON_CACHE_DIR`` points at a fresh, empty folder (the command's workers
  inherit it), so every kernel variant the search reaches is compiled on the way;
- ``warm``: the same command again with the same cache folder, now filled.

A row's ``seconds_to_detect`` counts from the command's process start to the row's first
sight of a failure (the worker's message before shrinking; ``harness/matrix.py``), so it
includes Python and torch imports, worker start-up and compilation; ``examples_to_detect``
is the searched examples up to it; ``seconds`` is when the row ended (shrunk and
diagnosed). Writes JSON (``--out``): per pass the rows and the medians over caught rows, the
machine (CPU model, GPU name), torch/triton/python versions, the git commit and the
commands. Rows run one after another, so they do not compete for the machine, unless
``--parallel N`` measures N mutants at once (recorded in the json's settings).

    python3 benchmarks/detection.py --graph emulated --only item-in-capture,ragged-item-sync \
        --examples 20 --out /tmp/det.json
    python3 benchmarks/detection.py --graph cuda --out benchmarks/results/<gpu>-<date>-detection.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package (mla_fuzz) when run from a checkout
FORMAT = "mla-fuzz-detection-bench/1"
PASSES = ("cold", "warm")


def default_mutants(graph: str, mutant_set: str | None = None) -> list[str]:
    """Every mutant of the set (``public``: ``ALL``, ``heldout``: ``heldout.HELDOUT``); on a GPU
    mode without the interpreter-only ones (``mla-fuzz mutants`` does the same)."""
    from mla_fuzz.harness.mutants import ALL, INTERPRETER_ONLY
    if mutant_set == "heldout":
        from mla_fuzz.harness.mutants.heldout import HELDOUT as ALL  # noqa: N811
    names = sorted(ALL)
    if graph in ("cuda", "auto") and _cuda():
        names = [n for n in names if n not in INTERPRETER_ONLY]
    return names


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def row_command(name: str, args, json_path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "mla_fuzz.harness.cli", "mutants", "--only", name, "--no-clean",
           "--graph", args.graph, "--spec", args.spec, "--examples", str(args.examples), "--seed", str(args.seed),
           "--workers", str(args.workers), "--json", str(json_path)]
    if args.max_seq_len:
        cmd += ["--max-seq-len", str(args.max_seq_len)]
    if getattr(args, "mutant_set", None):
        cmd += ["--set", args.mutant_set]
    if args.case_timeout:
        cmd += ["--case-timeout", str(args.case_timeout)]
    return cmd


def run_row(name: str, args, cache_dir: Path, work: Path, pass_name: str) -> dict:
    """One ``mla-fuzz mutants --only NAME`` command with ``TRITON_CACHE_DIR=cache_dir``; its row."""
    out = work / f"{pass_name}-{name}.json"
    cmd = row_command(name, args, out)
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(path))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.row_timeout)
        code, stderr, stdout = proc.returncode, proc.stderr, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code, stderr, stdout = None, _text(exc.stderr), _text(exc.stdout)
    wall = time.monotonic() - t0
    row = {"name": name, "command": shlex.join(cmd), "exit_code": code, "wall_s": round(wall, 3),
           "cache_files_before": None}
    if code is None:
        # cut by --row-timeout: the row still counts as caught if the command had said so
        # (its live "FOUND at example N" line), with that first sight
        row["error"] = f"timed out after {args.row_timeout:g} s"
        sight = _SIGHT.search(stderr or "")
        if sight:
            row.update(caught=True, seconds_to_detect=float(sight[1]), examples_to_detect=int(sight[2]),
                       timed_out_after_sight=True)
        return row
    try:
        m = json.loads(out.read_text())
    except (OSError, ValueError):
        row["error"] = (stderr or stdout or "no output")[-2000:]
        return row
    r = (m.get("rows") or [{}])[0]
    for k in ("caught", "seconds_to_detect", "examples_to_detect", "seconds", "row_started_s",
              "search_seconds_to_detect", "examples", "shrink_runs", "diagnosis", "matches", "error"):
        row[k] = r.get(k)
    return row


# the mutants command's first-sight line: "[mla-fuzz] 4.2s: NAME: FOUND at example 6 (shrinking...)"
_SIGHT = re.compile(r"\[mla-fuzz\] ([0-9.]+)s: \S+: FOUND at example (\d+)")


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _median(values):
    values = [v for v in values if v is not None]
    return None if not values else round(statistics.median(values), 3)


def summarize(rows: list[dict]) -> dict:
    """Medians of ``seconds_to_detect`` and ``examples_to_detect`` over the caught rows, and
    the rows that were not caught."""
    caught = [r for r in rows if r.get("caught")]
    return {"rows": len(rows), "caught": len(caught),
            "not_caught": [r["name"] for r in rows if not r.get("caught")],
            "median_seconds_to_detect": _median(r.get("seconds_to_detect") for r in caught),
            "median_examples_to_detect": _median(r.get("examples_to_detect") for r in caught),
            "median_seconds_final": _median(r.get("seconds") for r in caught),
            "max_seconds_to_detect": max((r["seconds_to_detect"] for r in caught
                                          if r.get("seconds_to_detect") is not None), default=None)}


def machine() -> dict:
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    info = {"cpu": cpu, "cpus": cpus, "platform": platform.platform(), "gpu": None, "gpus": 0}
    try:
        import torch
        if torch.cuda.is_available():
            info["gpus"] = torch.cuda.device_count()
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return info


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": None, "triton": None}
    try:
        import torch
        out["torch"] = torch.__version__
    except Exception:
        pass
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        pass
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout
        out["git"] = head.strip() + ("-dirty" if dirty.strip() else "")
    except OSError:
        out["git"] = None
    return out


def _line(pass_name: str, r: dict) -> str:
    head = f"{pass_name:<5} {r['name']:<30} "
    if r.get("error") and r.get("caught") is None:
        last = (r["error"].strip().splitlines() or ["?"])[-1]
        return head + f"error (exit {r['exit_code']}): {last}"
    s = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    examples = r.get("examples_to_detect") if r.get("caught") else r.get("examples")
    return (head + f"{'yes' if r.get('caught') else 'NO':<6} {str(examples):>8} {s(r.get('seconds_to_detect')):>11} "
            f"{s(r.get('seconds')):>8} {r['wall_s']:>7.1f}  {r.get('diagnosis') or '-'}")


HEADER = (f"{'pass':<5} {'mutant':<30} {'caught':<6} {'examples':>8} {'first sight':>11} {'final':>8} {'wall':>7}  "
          "diagnosis")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--graph", default="auto", help="graph mode: auto, cuda, emulated, eager (default auto)")
    ap.add_argument("--spec", default="tiny", help="tiny or deepseek-v3 (default tiny)")
    ap.add_argument("--only", default=None, help="comma-separated mutants (default: every one the mode can see)")
    ap.add_argument("--examples", type=int, default=100, help="example limit per row (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", default="1", help="workers per command (default 1)")
    ap.add_argument("--max-seq-len", default=None)
    ap.add_argument("--case-timeout", default=None)
    ap.add_argument("--passes", default="cold,warm", help="cold,warm (default), or one of them; warm alone "
                    "reuses --cache-dir")
    ap.add_argument("--cache-dir", default=None, help="Triton cache folder for warm-only runs (default: a fresh "
                    "temporary folder per mutant, removed at the end)")
    ap.add_argument("--row-timeout", type=float, default=3600.0, help="seconds one command may take")
    ap.add_argument("--parallel", type=int, default=1, help="mutants measured at the same time, each its own "
                    "commands (default 1: one after another; more share the machine, and say so in the json)")
    ap.add_argument("--set", default=None, dest="mutant_set", help="passed to `mla-fuzz mutants --set` (public or "
                    "heldout); default: the command's own default")
    args = ap.parse_args(argv)
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not passes or any(p not in PASSES for p in passes):
        ap.error(f"--passes: expected a subset of {','.join(PASSES)}, got {args.passes!r}")
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else default_mutants(args.graph, args.mutant_set)
    rows = {p: {} for p in passes}
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="mla-fuzz-detection-") as tmp:
        work = Path(tmp)

        def measure(name: str) -> None:
            # a mutant's passes run in order (warm reuses the cache its cold pass filled)
            cache = Path(args.cache_dir) if args.cache_dir else work / f"triton-cache-{name}"
            cache.mkdir(parents=True, exist_ok=True)
            for p in passes:
                before = sum(1 for _ in cache.rglob("*") if _.is_file())
                if p == "cold" and before:
                    print(f"note: {cache} is not empty ({before} files): the cold pass is not cold", file=sys.stderr)
                r = run_row(name, args, cache, work, p)
                r["cache_files_before"] = before
                rows[p][name] = r
                print(_line(p, r), flush=True)

        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as ex:
            list(ex.map(measure, names))
        rows = {p: [rows[p][n] for n in names if n in rows[p]] for p in passes}
    doc = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["detection.py", *argv]),
        "settings": {"graph": args.graph, "spec": args.spec, "examples": args.examples, "seed": args.seed,
                     "workers": args.workers, "max_seq_len": args.max_seq_len, "mutants": names,
                     "parallel": args.parallel, "set": args.mutant_set},
        "machine": machine(), "versions": versions(),
        "passes": {p: {"summary": summarize(rows[p]), "rows": rows[p]} for p in passes},
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for p in passes:
        s = doc["passes"][p]["summary"]
        print(f"{p}: caught {s['caught']}/{s['rows']}, median first sight {s['median_seconds_to_detect']}s "
              f"(final {s['median_seconds_final']}s), median examples {s['median_examples_to_detect']}", flush=True)
    print(f"results: {args.out}")
    bad = [r for p in passes for r in rows[p] if not r.get("caught")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
