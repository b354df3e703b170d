"""Seconds from a command's start to its workers and its first findings, run after run (#44).

Runs ``mla-fuzz mutants --only ROWS --examples N --no-clean`` ``--repeats`` times in new
processes, as a user would, for each variant and each mode:

- a variant is an environment added to the commands' (``--variant NAME=KEY=VAL[;KEY=VAL...]``,
  e.g. ``early=MLA_FUZZ_CUDA_EARLY=1``; ``PYTHONPATH=DIR`` runs another checkout of mla-fuzz);
  without ``--variant``, one variant ``default`` adds nothing;
- ``server``: an ``mla-fuzz server`` is started first for the variant's environment (its
  imports not counted, as a user who started one earlier); ``none``: ``MLA_FUZZ_SERVER=0``,
  the command imports through its own zygote.

Runs interleave the variants and modes so that a machine that drifts spreads over all of them.
Per run: when the command forked its workers (its ``N s: workers`` line), and per row when a
worker took it and when it first saw a failure, in seconds from the command's start. Writes
JSON (``--out``) with the per-run figures, the medians per variant and mode, the machine and
versions. Servers live in a private temporary folder and are stopped at the end.

    python3 benchmarks/command_start.py --graph emulated --workers 2 --repeats 5 --out F.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
FORMAT = "mla-fuzz-command-start/1"
_WORKERS = re.compile(r"\] ([0-9.]+)s: workers: ")


def _variant(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition("=")
    env = {}
    for item in (rest.split(";") if rest else []):
        k, eq, v = item.partition("=")
        if not (k and eq):
            raise SystemExit(f"command_start.py: --variant {text!r}: expected NAME=KEY=VAL[;KEY=VAL...]")
        env[k] = v
    if not (name and sep):
        raise SystemExit(f"command_start.py: --variant {text!r}: expected NAME=KEY=VAL[;KEY=VAL...]")
    return name, env


def _cli(args: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def one_run(env: dict, cwd: Path, command: list[str], timeout: float) -> dict:
    """One command in new processes: its workers' fork time and each row's start and sight."""
    out = cwd / "m.json"
    out.unlink(missing_ok=True)
    r = _cli([*command, "--json", str(out)], env, cwd, timeout)
    if not out.exists():
        return {"error": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"}
    rows = json.loads(out.read_text())["rows"]
    w = _WORKERS.search(r.stderr)
    seen = [x["seconds_to_detect"] for x in rows if x["seconds_to_detect"] is not None]
    return {"exit": r.returncode, "in_server": "forked from the mla-fuzz server" in r.stderr,
            "workers_forked_s": float(w.group(1)) if w else None,
            "median_found_s": round(statistics.median(seen), 3) if seen else None,
            "rows": [{k: x.get(k) for k in ("backend", "examples_to_detect", "row_started_s", "seconds_to_detect")}
                     for x in rows]}


def main(argv=None) -> int:
    from detection import machine, versions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--graph", default="cuda")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--workers", default="2")
    ap.add_argument("--only", default="item-in-capture,context-lens-in-place",
                    help="mutants, comma-separated (default: two found in one example)")
    ap.add_argument("--examples", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="server,none")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--extra", default="", help="more arguments for every command, space-separated (e.g. --mps)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per command")
    ap.add_argument("--note", action="append", default=[], help="a line kept in the JSON (which trees, why)")
    args = ap.parse_args(argv)
    variants = [_variant(v) for v in args.variant] or [("default", {})]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"server", "none"}:
        raise SystemExit(f"command_start.py: --modes {args.modes!r}: server, none or both")
    command = ["mutants", "--graph", args.graph, "--spec", args.spec, "--workers", args.workers, "--only", args.only,
               "--examples", str(args.examples), "--no-clean", *args.extra.split()]
    doc = {"format": FORMAT, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["benchmarks/command_start.py", *(sys.argv[1:] if argv is None else argv)]),
           "mutants_command": " ".join(["mla-fuzz", *command]), "variants": dict(variants),
           "clock": "seconds from the command's start; a server's imports are not counted", "notes": args.note,
           "runs": []}
    with tempfile.TemporaryDirectory(prefix="mla-fuzz-command-start-") as tmp:
        base = dict(os.environ, MLA_FUZZ_SERVER_DIR=str(Path(tmp) / "servers"))
        envs = {(name, mode): dict(base, **extra, MLA_FUZZ_SERVER="1" if mode == "server" else "0")
                for name, extra in variants for mode in modes}
        try:
            for (name, mode), env in envs.items():
                if mode == "server":
                    r = _cli(["server", "start", "--graph", args.graph], env, Path(tmp), args.timeout)
                    if r.returncode != 0:
                        raise SystemExit(f"command_start.py: server for {name}: {r.stdout}{r.stderr}".strip())
            for i in range(args.repeats):
                for (name, mode), env in envs.items():
                    run = {"variant": name, "mode": mode, "repeat": i,
                           **one_run(env, Path(tmp), command, args.timeout)}
                    doc["runs"].append(run)
                    print(f"{name} {mode} #{i}: workers {run.get('workers_forked_s')}s, median first finding "
                          f"{run.get('median_found_s')}s{'; ' + run['error'] if 'error' in run else ''}", flush=True)
        finally:
            for (name, mode), env in envs.items():
                if mode == "server":
                    _cli(["server", "stop"], env, Path(tmp), 60)

    def med(name, mode, key):
        vals = [r[key] for r in doc["runs"] if r["variant"] == name and r["mode"] == mode and r.get(key) is not None]
        return round(statistics.median(vals), 3) if vals else None
    doc["summary"] = [{"variant": name, "mode": mode, "median_workers_forked_s": med(name, mode, "workers_forked_s"),
                       "median_found_s": med(name, mode, "median_found_s")} for name, _ in variants for mode in modes]
    doc["machine"], doc["versions"] = machine(), versions()
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for s in doc["summary"]:
        print(f"{s['variant']} {s['mode']}: workers forked {s['median_workers_forked_s']}s, "
              f"median first finding {s['median_found_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
