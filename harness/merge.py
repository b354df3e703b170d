"""``mla-fuzz merge``: one report and one corpus from the shards of a campaign.

Shards (``mla-fuzz run --shard I/N``) run disjoint chunks of one seeded campaign on
different machines, each with its own ``--json`` report and ``--corpus``. Merging checks
that the reports belong to one campaign (backend, graph mode, spec, seed), adds up their
counts and coverage, and unions their failures by signature (``harness.repro.signature``):
of the repros of one signature the smaller (fewer steps, then shorter JSON) is written to
the merged corpus, and the counts add up. Overlapping chunk sets and missing shards are
warnings: the counts are still the sum of what ran.

A merged report is a campaign report (``mla-fuzz-report/1``) with ``shard`` null and the
shards it covers in ``shards``, so merged reports can be merged again.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from .atomic import read_json
from .campaign import merge_coverage
from .render import coverage_parts, table, unsupported_lines
from .repro import ReproError, load_repro, signature, write_repro

REPORT_FORMAT = "mla-fuzz-report/1"
# what makes reports one campaign (a difference is an error)
IDENTITY = ("backend", "graph_mode", "spec", "seed")
# what the shards of one campaign normally share (a difference is a warning)
SETTINGS = ("chunk", "examples_limit", "narrow")


class MergeError(ValueError):
    """A report that cannot be merged: missing, not a report, another campaign, a repro
    that cannot be read. One line."""


def load_report(path: str | Path) -> dict:
    p = Path(path)
    data = read_json(p, MergeError)
    if not isinstance(data, dict) or data.get("format") != REPORT_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise MergeError(f"{p}: not an mla-fuzz campaign report (expected format {REPORT_FORMAT!r}, got {got!r})")
    for key in IDENTITY + ("failures",):
        if key not in data:
            raise MergeError(f"{p}: missing field {key!r}")
    if not isinstance(data["failures"], list):
        raise MergeError(f"{p}: 'failures' must be a list")
    for key in ("examples", "steps", "chunks", "restarts", "workers"):
        if not isinstance(data.get(key, 0), int):
            raise MergeError(f"{p}: {key!r} must be an integer, got {data[key]!r}")
    for key in ("coverage", "unsupported", "failures_by_class"):
        if not isinstance(data.get(key) or {}, dict):
            raise MergeError(f"{p}: {key!r} must be an object")
    pairs = ([data["shard"]] if data.get("shard") is not None else []) + list(data.get("shards") or [])
    pairs += list(data.get("chunks_run") or [])
    if not isinstance(data.get("chunks_run", []), list) or not all(_int_pair(x) for x in pairs):
        raise MergeError(f"{p}: 'shard', 'shards' and 'chunks_run' must hold [integer, integer] pairs")
    return data


def _int_pair(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and v >= 0 for v in x)


def _shards(rep: dict) -> list[tuple[int, int]]:
    """The shards a report covers: a merged report's ``shards``, else its ``shard`` (0/1
    for a report made before ``--shard``)."""
    if rep.get("shards"):
        return [tuple(s) for s in rep["shards"]]
    return [tuple(rep.get("shard") or (0, 1))]


def _label(shards) -> str:
    return ",".join(f"{i}/{n}" for i, n in shards)


def _repro_path(path: str, report_path: Path) -> Path:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (report_path.parent / p).exists():
        return report_path.parent / p  # a report moved together with its corpus
    return p


def _size(repro: dict) -> tuple[int, int]:
    return len(repro["steps"]), len(json.dumps(repro, indent=2))


def merge_reports(paths: list[str], corpus: Path) -> dict:
    """Merge the reports at ``paths``; write the winning repros to ``corpus``; return the
    merged report. ``MergeError`` before anything is written when a report or a repro it
    names cannot be used, or the reports are not of one campaign."""
    reports = [(Path(p), load_report(p)) for p in paths]
    first_path, first = reports[0]
    warnings: list[str] = []
    for path, rep in reports[1:]:
        for key in IDENTITY:
            if rep[key] != first[key]:
                raise MergeError(f"{path}: not the same campaign as {first_path}: {key} "
                                 f"{json.dumps(rep[key])} != {json.dumps(first[key])}")
        for key in SETTINGS:
            if rep.get(key) != first.get(key):
                warnings.append(f"{path}: {key} {json.dumps(rep.get(key))} differs from {first_path}'s "
                                f"{json.dumps(first.get(key))}")

    # failures: load every repro first (all-or-nothing), the smaller of a signature wins
    best: dict[str, dict] = {}
    for path, rep in reports:
        label = _label(_shards(rep))
        for f in rep["failures"]:
            if not isinstance(f, dict) or not f.get("path"):
                raise MergeError(f"{path}: a failure without a repro path ({f!r:.80})")
            rp = _repro_path(f["path"], path)
            try:
                repro = load_repro(rp)
            except ReproError as exc:
                raise MergeError(f"{path}: repro of failure {f.get('signature', '?')!r}: {exc}") from None
            sig = signature(repro)
            entry = best.get(sig)
            if entry is None:
                best[sig] = {"repro": repro, "info": f, "count": int(f.get("count") or 1),
                             "found_at_s": f.get("found_at_s"), "found_in": [label]}
                continue
            entry["count"] += int(f.get("count") or 1)
            entry["found_in"].append(label)
            if f.get("found_at_s") is not None and (entry["found_at_s"] is None
                                                    or f["found_at_s"] < entry["found_at_s"]):
                entry["found_at_s"] = f["found_at_s"]
            if _size(repro) < _size(entry["repro"]):
                entry["repro"], entry["info"] = repro, f

    # coverage of the campaign's chunks
    shard_sets = [s for _, rep in reports for s in _shards(rep)]
    ns = sorted({n for _, n in shard_sets})
    if len(ns) > 1:
        warnings.append(f"the reports split the campaign differently (shard counts {', '.join(map(str, ns))}): "
                        "their chunk sets may overlap or leave gaps")
    else:
        n = ns[0]
        dup = sorted(s for s, c in Counter(shard_sets).items() if c > 1)
        if dup:
            warnings.append(f"shard(s) {_label(dup)} appear more than once: their counts are added more than once")
        missing = [i for i in range(n) if (i, n) not in shard_sets]
        if missing:
            warnings.append(f"shard(s) {_label((i, n) for i in missing)} missing: the merged campaign does not cover "
                            f"their chunks")
    owner: dict[tuple, Path] = {}
    overlaps: dict[tuple, list[int]] = {}
    chunks_run = set()
    for path, rep in reports:
        if "chunks_run" not in rep:
            warnings.append(f"{path}: no chunks_run in the report (made before --shard): chunk coverage not checked")
            continue
        for k, seed in rep["chunks_run"]:
            key = (int(k), int(seed))
            if key in owner and owner[key] != path:
                overlaps.setdefault((owner[key], path), []).append(key[0])
            owner.setdefault(key, path)
            chunks_run.add(key)
    for (a, b), ks in overlaps.items():
        shown = ", ".join(map(str, sorted(ks)[:10])) + (", ..." if len(ks) > 10 else "")
        warnings.append(f"{a} and {b} both ran chunk(s) {shown}: their counts are added twice")

    # per spec (a campaign of interleaved specs): searched examples, steps and chunks add up
    specs: dict = {}
    for _, rep in reports:
        for name, d in (rep.get("specs") or {}).items():
            if not isinstance(d, dict):
                continue
            into = specs.setdefault(name, {"examples": 0, "steps": 0, "chunks": 0, "max_seq_len": d.get("max_seq_len")})
            for key in ("examples", "steps", "chunks"):
                into[key] += int(d.get(key) or 0)

    # counts
    coverage: dict = {}
    unsupported: Counter = Counter()
    by_class: Counter = Counter()
    errors: list[str] = []
    for path, rep in reports:
        merge_coverage(coverage, rep.get("coverage"))
        unsupported.update(rep.get("unsupported") or {})
        by_class.update(rep.get("failures_by_class") or {})
        errors += [f"{path}: {e}" for e in rep.get("errors") or []]
        warnings += [f"{path}: {w}" for w in rep.get("warnings") or []]
        if rep.get("exit_code") not in (None, 0, 1):
            warnings.append(f"{path}: its campaign ended with exit code {rep['exit_code']}"
                            + (" (interrupted)" if rep.get("interrupted") else ""))

    # write the winners (after every check: a failed merge leaves the corpus as it was)
    failures = []
    for sig, e in best.items():
        repro, info = e["repro"], e["info"]
        path = write_repro(repro, corpus)
        fail = repro.get("failure") or {}
        failures.append({"signature": sig, "class": (repro.get("diagnosis") or {}).get("cls") or "unknown",
                         "oracle": fail.get("oracle", "?"), "message": fail.get("message", ""), "path": str(path),
                         "count": e["count"], "steps": len(repro["steps"]), "found_at_s": e["found_at_s"],
                         "examples_to_detect": info.get("examples_to_detect"),
                         "reduced_from": info.get("reduced_from"), "found_in": e["found_in"],
                         "from": str(info["path"])})

    def total(key):
        return sum(int(rep.get(key) or 0) for _, rep in reports)

    starts = sorted(rep["started"] for _, rep in reports if rep.get("started"))
    caps = next((rep["capabilities"] for _, rep in reports if rep.get("capabilities")), None)
    elapsed = max(float(rep.get("elapsed_s") or 0.0) for _, rep in reports)
    return {
        "format": REPORT_FORMAT, "backend": first["backend"], "graph_mode": first["graph_mode"],
        "spec": first["spec"], "seed": first["seed"], "budget_s": first.get("budget_s"),
        "examples_limit": first.get("examples_limit"), "workers": total("workers"),
        "case_timeout_s": first.get("case_timeout_s"), "chunk": first.get("chunk"), "corpus": str(corpus),
        "started": starts[0] if starts else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": round(elapsed, 3),  # the longest shard's
        "examples": total("examples"), "steps": total("steps"), "startup_s": None,
        "shrink_runs": total("shrink_runs"),
        "shrink_s": round(sum(float(rep.get("shrink_s") or 0.0) for _, rep in reports), 3),
        "diagnose_s": round(sum(float(rep.get("diagnose_s") or 0.0) for _, rep in reports), 3),
        # the shards' rates added up: the campaign's rate when they ran at the same time
        "cases_per_s": round(sum(float(rep.get("cases_per_s") or 0.0) for _, rep in reports), 3),
        "chunks": total("chunks"), "restarts": total("restarts"),
        "interrupted": any(rep.get("interrupted") for _, rep in reports), "coverage": coverage,
        "capabilities": caps, "narrow": first.get("narrow"), "unsupported": dict(unsupported),
        "failures_by_class": dict(by_class), "failures": failures, "errors": errors, "warnings": warnings,
        "shard": None, "shards": [list(s) for s in shard_sets],
        "chunks_run": [list(c) for c in sorted(chunks_run)],
        "merged_from": [str(p) for p, _ in reports], "specs": specs,
        "exit_code": 1 if failures else 0,
    }


def summary_lines(report: dict) -> list[str]:
    """What ``mla-fuzz merge`` prints: the campaign, the summed counts, coverage, the
    distinct failures and the warnings (as ``mla-fuzz run``'s summary)."""
    r = report
    lines = [f"mla-fuzz merge: {len(r['merged_from'])} report(s), backend {r['backend']}, graph {r['graph_mode']}, "
             f"spec {r['spec']}, seed {r['seed']}, shards {_label(tuple(s) for s in r['shards'])}"
             + (" -- some INTERRUPTED" if r["interrupted"] else ""),
             f"  {r['examples']} cases, {r['steps']} steps, {r['chunks']} chunks, {r['restarts']} worker restart(s); "
             f"longest shard {r['elapsed_s']:.1f}s, {r['cases_per_s']:.2f} cases/s in all"]
    cov = coverage_parts(r["coverage"])
    if cov:
        lines.append("  coverage:")
        lines += [f"    {label:<8} {vals}" for label, vals in cov]
    lines += unsupported_lines(r["unsupported"])
    if r["failures"]:
        n = sum(f["count"] for f in r["failures"])
        lines.append(f"failures: {len(r['failures'])} distinct ({n} in all); repros in {r['corpus']}")
        rows = [[f["class"], f["oracle"], f["count"],
                 f["steps"] if f["reduced_from"] is None else f"{f['steps']} (from {f['reduced_from']})",
                 "" if f["found_at_s"] is None else f"{f['found_at_s']:.1f}s", " ".join(f["found_in"]), f["path"]]
                for f in r["failures"]]
        lines += table(["class", "oracle", "count", "steps", "found", "shards", "repro"], rows)
    else:
        lines.append("no failures found")
    lines += ["warning: " + w for w in r["warnings"]]
    lines += ["error: " + e for e in r["errors"]]
    return lines
