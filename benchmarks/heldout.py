"""The held-out mutants (``harness.mutants.heldout``), measured one by one on a given source tree.

For each held-out mutant and seed: ``fuzz("mutant:NAME", spec="tiny", graph_mode="emulated",
examples=N, seed=S, shrink_seconds=20)`` with ``TRITON_INTERPRET=1`` (kernels interpreted,
graphs emulated: the CPU protocol of ``results/cpu-2026-11-28-fresh-mutants.json``), each in
a fresh process whose ``mla_fuzz`` is the one of ``--tree`` (checked: a ``mla_fuzz`` installed
in editable mode from another checkout would otherwise win for a script's imports). Rows run
one after another, so they do not compete for the machine.

Per row: ``caught``, ``examples`` (searched), ``examples_to_detect``, ``seconds_to_detect``
(first sight, from the fuzz() call's start), ``wall_seconds`` (the whole fuzz() call: search,
shrinking up to ``--shrink-seconds``, diagnosis), the failing ``oracle``, the ``diagnosis``
class and whether it is one ``HELDOUT_EXPECTED`` accepts (``diagnosis_right``), the
explanation's first line, ``shrunk_steps`` / ``unshrunk_steps``, ``flaky`` (Hypothesis could not
shrink it: the failure as found is reported) and ``parent_passes_repro`` (the mutant's clean
parent class passes the shrunk repro: the finding is the bug put back, not a harness fault).

The "before" measurement ran the tree at commit 7a54e21 (a ``git worktree`` with only
``harness/mutants/heldout.py`` and the loader's held-out lookup copied in); an "after"
measurement of a later search runs the same command on that tree:

    python3 benchmarks/heldout.py --tree . --out benchmarks/results/cpu-DATE-heldout-after.json
    python3 benchmarks/heldout.py --tree /tmp/base --seeds 0 --examples 50 --only stale-slot-tail --out /tmp/h.json

``--only`` may also name public mutants (``harness.mutants.ALL``): measured the same way, e.g. a
mutant's diagnosis over many seeds before and after a change to the diagnosis.

The held-out set must stay unseen by the search's tuning: read the numbers, do not tune on
the mutants (their failing inputs are nowhere in the repository on purpose).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FORMAT = "mla-fuzz-heldout/1"
HERE = Path(__file__).resolve().parent


def protocol(args) -> str:
    return (f"held-out mutants (harness.mutants.heldout, not in harness.mutants.ALL), each measured untouched with "
            f"fuzz('mutant:NAME', spec='tiny', graph_mode='emulated', examples={args.examples}, seed=S, "
            f"shrink_seconds={args.shrink_seconds:g}) under TRITON_INTERPRET=1, seeds {args.seeds}, one fresh "
            f"process per row, rows one after another (benchmarks/heldout.py)")


# ----------------------------------------------------------------------------- one row (child)

def _row(tree: Path, name: str, seed: int, examples: int, shrink_seconds: float) -> dict:
    """Measure one (mutant, seed) in this process; the tree's ``mla_fuzz`` must be the one imported."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(tree))
    import mla_fuzz.harness
    where = Path(mla_fuzz.harness.__file__).resolve()
    if tree.resolve() not in where.parents:
        raise SystemExit(f"heldout.py: mla_fuzz.harness resolves to {where}, not inside --tree {tree}: run from "
                         f"the tree (cd there) or uninstall the editable mla_fuzz that shadows it")
    from mla_fuzz.harness.executor import run_steps
    from mla_fuzz.harness.fuzz import fuzz
    from mla_fuzz.harness.mutants import ALL, EXPECTED
    from mla_fuzz.harness.mutants.heldout import HELDOUT, HELDOUT_EXPECTED
    from mla_fuzz.harness.scenario import ScenarioConfig

    classes, expect = {**ALL, **HELDOUT}, {**EXPECTED, **HELDOUT_EXPECTED}
    expected = sorted(expect.get(name, ()))
    row = {"mutant": name, "seed": seed, "expected": expected, "harness": str(where.parent)}
    t0 = time.monotonic()
    try:
        rep = fuzz(f"mutant:{name}", spec="tiny", graph_mode="emulated", examples=examples, seed=seed,
                   shrink_seconds=shrink_seconds)
    except Exception as exc:  # a harness error is a result too: recorded, not hidden
        row.update(caught=False, error=f"{type(exc).__name__}: {exc}", wall_seconds=time.monotonic() - t0)
        return row
    wall = time.monotonic() - t0
    repro = rep.repro
    row.update(caught=repro is not None, examples=rep.examples, examples_to_detect=rep.examples_to_detect,
               seconds_to_detect=rep.seconds_to_detect, wall_seconds=wall, oracle=None, diagnosis=None,
               diagnosis_right=None, explanation_first_line=None, shrunk_steps=None, unshrunk_steps=None,
               flaky=None, parent_passes_repro=None)
    if repro is None:
        return row
    diag = repro.get("diagnosis") or {}
    search = repro.get("search") or {}
    row.update(oracle=(repro.get("failure") or {}).get("oracle"), diagnosis=diag.get("cls"),
               diagnosis_right=diag.get("cls") in expected,
               explanation_first_line=(diag.get("explanation") or "").splitlines()[0] if diag.get("explanation") else None,
               shrunk_steps=len(repro["steps"]), unshrunk_steps=search.get("unshrunk_steps"), flaky=search.get("flaky"))
    parent = classes[name].__mro__[1]  # the clean backend the mutant subclasses
    try:
        row["parent_passes_repro"] = run_steps(parent, ScenarioConfig.from_dict(repro["config"]), repro["steps"],
                                               "emulated", "cpu") is None
    except Exception as exc:
        row["parent_passes_repro"] = f"error: {type(exc).__name__}: {exc}"
    return row


# ----------------------------------------------------------------------------- the driver

def _versions(tree: Path) -> dict:
    code = ("import sys, torch, triton, hypothesis; print(sys.version.split()[0], torch.__version__, "
            "triton.__version__, hypothesis.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree).stdout.split()
    return dict(zip(("python", "torch", "triton", "hypothesis"), out))


def _commit(tree: Path) -> str:
    def git(*a):
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (+ uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(HERE.parent), help="source tree whose mla_fuzz is measured (default: "
                    "this script's repository)")
    ap.add_argument("--out", required=True, metavar="FILE", help="where the JSON goes")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    ap.add_argument("--examples", type=int, default=300, help="examples per row (default 300)")
    ap.add_argument("--shrink-seconds", type=float, default=20.0, help="shrinking bound per row (default 20)")
    ap.add_argument("--only", default=None, help="comma-separated mutant names (default: every held-out one; a "
                    "public mutant is measured the same way)")
    ap.add_argument("--commit", default=None, help="what to record as the measured commit (default: the tree's "
                    "HEAD, noting uncommitted changes)")
    ap.add_argument("--tree-note", default=None, help="recorded as tree_note: what differs from the commit")
    ap.add_argument("--machine", default=None, help="the machine line (default: CPU count, torch and triton)")
    ap.add_argument("--row-timeout", type=float, default=3600.0, help="seconds one row may take")
    ap.add_argument("--_row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tree = Path(args.tree).resolve()
    if args._row is not None:  # child: one row, as one JSON line on stdout
        print("HELDOUT-ROW " + json.dumps(_row(tree, args._row, args._seed, args.examples, args.shrink_seconds)),
              flush=True)
        return 0

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.seeds = ",".join(map(str, seeds))
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
    else:
        listing = subprocess.run([sys.executable, "-c", "from mla_fuzz.harness.mutants.heldout import HELDOUT; "
                                  "print(' '.join(HELDOUT))"], capture_output=True, text=True, cwd=tree,
                                 env={**os.environ, "PYTHONPATH": str(tree)})
        if listing.returncode:
            print(listing.stderr, file=sys.stderr)
            return 2
        names = listing.stdout.split()
    versions = _versions(tree)
    machine = args.machine or (f"{os.cpu_count()}-core CPU, torch {versions.get('torch')}, "
                               f"triton {versions.get('triton')} interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    rows = []
    started = time.time()
    for name in names:
        for seed in seeds:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--tree", str(tree), "--_row", name,
                   "--_seed", str(seed), "--examples", str(args.examples), "--shrink-seconds", str(args.shrink_seconds),
                   "--out", "-"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=args.row_timeout)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HELDOUT-ROW ")), None)
                if line is None:
                    row = {"mutant": name, "seed": seed, "caught": False,
                           "error": f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])}
                else:
                    row = json.loads(line[len("HELDOUT-ROW "):])
            except subprocess.TimeoutExpired:
                row = {"mutant": name, "seed": seed, "caught": False, "error": f"row timeout {args.row_timeout:g}s"}
            rows.append(row)
            what = (f"caught after {row.get('examples_to_detect')} examples ({row.get('seconds_to_detect') or 0:.1f}s): "
                    f"{row.get('diagnosis')} ({'right' if row.get('diagnosis_right') else 'wrong'})"
                    if row.get("caught") else ("ERROR " + row["error"] if row.get("error")
                                               else f"escaped {row.get('examples')} examples"))
            print(f"{name} seed {seed}: {what}, wall {row.get('wall_seconds') or 0:.1f}s", flush=True)
    summary = {}
    for seed in seeds:
        rs = [r for r in rows if r["seed"] == seed]
        summary[f"seed {seed}"] = {"caught": sum(bool(r.get("caught")) for r in rs),
                                   "diagnosis_right": sum(bool(r.get("diagnosis_right")) for r in rs), "rows": len(rs)}
    doc = {
        "format": FORMAT,
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "protocol": protocol(args),
        "commit": args.commit or _commit(tree),
        "tree_note": args.tree_note,
        "settings": {"spec": "tiny", "graph_mode": "emulated", "examples": args.examples, "seeds": seeds,
                     "shrink_seconds": args.shrink_seconds, "mutants": names},
        "versions": versions,
        "wall_s": round(time.time() - started, 1),
        "summary": summary,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
