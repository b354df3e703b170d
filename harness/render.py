"""Plain-text rendering for the command line: scenario steps, coverage, summary tables.

Everything here returns strings (no printing, no colour), so it reads the same in a
terminal, a CI log and a test; ``harness.progress`` adds rich formatting on a TTY.
"""
from __future__ import annotations

# The dimensions the live display and the summary show first, in this order.
COVERAGE_ORDER = ("next_n", "kv_dtype", "mtp", "padding", "seq_len", "longest", "split", "op", "path",
                  "layers", "page_size", "heads", "spec")
COVERAGE_LABEL = {"kv_dtype": "kv", "mtp": "MTP", "padding": "padding", "seq_len": "seq_len",
                  "op": "ops", "page_size": "page"}


def spec_label(spec: dict) -> str:
    """``tiny (8 heads)``, ``deepseek-v3`` or ``custom (rank 256, rope 32, 16 heads)``."""
    from mla_fuzz.mla_ref import ModelSpec
    try:
        s = ModelSpec.from_dict(spec)
    except (ValueError, TypeError):
        return "invalid spec"
    if s == ModelSpec.deepseek_v3():
        return "deepseek-v3"
    if s == ModelSpec.tiny(num_heads=s.num_heads):
        return f"tiny ({s.num_heads} heads)"
    return f"custom (rank {s.kv_lora_rank}, rope {s.qk_rope_head_dim}, {s.num_heads} heads)"


def config_line(cfg: dict) -> str:
    """One line describing a ``ScenarioConfig`` dict."""
    parts = [f"spec {spec_label(cfg.get('spec', {}))}", f"kv {cfg.get('kv_dtype')}", f"q {cfg.get('q_dtype')}",
             f"page {cfg.get('page_size')}", f"next_n {cfg.get('next_n')}",
             f"capture sizes {cfg.get('capture_sizes')}", f"max pages/seq {cfg.get('max_pages_per_seq')}"]
    if cfg.get("pool_pages") is not None:
        parts.append(f"pool {cfg['pool_pages']} pages")
    if cfg.get("layer"):
        parts.append("layer" + (" + fp8 out" if cfg.get("fp8_out") else ""))
    if (cfg.get("layers") or 1) > 1:
        parts.append(f"{cfg['layers']} layers per step")
    parts.append(f"seed {cfg.get('seed')}")
    return ", ".join(parts)


def step_line(i: int, step: dict) -> str:
    """``  2  replay   size 4  B=3  seq_lens [0, 17, 64]  q_lens [0, 1, 1]  max_decode_len 1  poison  seed 7``

    Capture steps also show ``warmups N`` (eager forwards before the capture) and ``one
    build`` (warmups and capture share one metadata build, as vLLM does); unknown keys are
    printed as ``key value`` so a newer repro still reads completely."""
    b = step.get("batch") or {}
    seq = b.get("seq_lens", [])
    head = f"{i:>3}  {step.get('op', '?'):<8}"
    parts = []
    if step.get("size") is not None:
        parts.append(f"size {step['size']}")
    parts.append(f"B={len(seq)}")
    parts.append(f"seq_lens {seq}")
    parts.append(f"q_lens {b.get('q_lens')}")
    if b.get("max_decode_len") is not None:
        parts.append(f"max_decode_len {b['max_decode_len']}")
    if b.get("k_scale") is not None:
        parts.append(f"k_scale {b['k_scale']:g}")
    if step.get("op") == "eager" and step.get("pad_to") is not None:
        parts.append(f"pad_to {step['pad_to']}")
    if step.get("poison"):
        parts.append("poison")
    if step.get("warmups"):
        parts.append(f"warmups {step['warmups']}")
    if step.get("share"):
        parts.append("one build")
    known = {"op", "batch", "size", "pad_to", "poison", "warmups", "share"}
    parts += [f"{k} {v}" for k, v in step.items() if k not in known]
    parts.append(f"seed {b.get('seed')}")
    return head + "  ".join(parts)


def scenario_lines(cfg: dict, steps: list[dict], failing: int | None = None, oracle: str | None = None) -> list[str]:
    """The config line, then one line per step; the failing step is marked ``>``."""
    out = ["config: " + config_line(cfg)]
    for i, s in enumerate(steps):
        line = step_line(i, s)
        if i == failing:
            line = ">" + line[1:] + f"   <- fails{': ' + oracle if oracle else ''}"
        out.append(line)
    return out


def coverage_parts(cov: dict) -> list[tuple[str, str]]:
    """``[(label, "1:40 2:31 3:12"), ...]`` in ``COVERAGE_ORDER``, then any other keys;
    ``longest`` as a token count and ``split`` as shares (``split_text``)."""
    keys = [k for k in COVERAGE_ORDER if k in cov] + sorted(k for k in cov if k not in COVERAGE_ORDER)
    out = []
    for k in keys:
        vals = cov[k]
        if k == "longest":
            out.append(("longest", f"{next(iter(vals), '0')} tokens"))
            continue
        if k == "split":
            out.append(("split", split_text(vals, cov.get("spec") or {})))
            continue
        if k == "path":  # shares of scenarios: the issue was a path drawn one time in 30
            total = sum(vals.values()) or 1
            out.append(("path", " ".join(f"{v}:{n} ({100 * n / total:.0f}%)" for v, n in sorted(vals.items()))))
            continue
        if k == "padding":  # the share of steps that ran padded rows
            steps = sum((cov.get("op") or {}).values())
            n = sum(vals.values())
            out.append(("padding", f"{n} steps with padded rows" + (f" ({100 * n / steps:.0f}% of steps)" if steps else "")))
            continue
        items = sorted(vals.items(), key=lambda kv: (_num(kv[0]), kv[0]))
        out.append((COVERAGE_LABEL.get(k, k), " ".join(f"{v}:{n}" for v, n in items)))
    return out


def split_text(split: dict, specs: dict) -> str:
    """``12% of rows (340/2800), 21 steps; scenarios tiny 80/300`` from the backend's
    ``kv_splits`` answers (rows split / real rows, steps with a split row, and per spec the
    scenarios with one)."""
    rows, done = split.get("rows", 0), split.get("rows split", 0)
    share = f"{100 * done / rows:.0f}% of rows ({done}/{rows})" if rows else "no rows"
    parts = [share, f"{split.get('steps split', 0)} steps"]
    per = [f"{fam} {split.get('scenarios split ' + fam, 0)}/{n}" for fam, n in sorted(specs.items())]
    return ", ".join(parts) + ("; scenarios " + ", ".join(per) if per else "")


def _num(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        return float("inf")


def table(headers: list[str], rows: list[list], indent: str = "  ") -> list[str]:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append(indent + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines


def finding_rows(result) -> list[list]:
    """One row per finding: ``found`` is its first sight, ``final`` when its shrunk, diagnosed
    repro was written (``-``: the repro is the failure as first seen, unshrunk)."""
    rows = []
    for f in result.findings.values():
        steps = len(f.repro["steps"])
        shrunk = getattr(f, "shrunk", True)
        if not shrunk:
            steps = f"{steps} (unshrunk)"
        elif f.reduced_from is not None:
            steps = f"{steps} (from {f.reduced_from})"
        at = getattr(f, "reduced_at_s", None)
        rows.append([f.cls, f.oracle, f.count, steps, f"{f.found_at_s:.1f}s",
                     "-" if not shrunk or at is None else f"{at:.1f}s", f.path])
    return rows


def shrink_line(result) -> str | None:
    """``  shrinking: 25 re-runs, 12.0s; diagnosis 3.1s (not counted as cases)``, or None."""
    runs = getattr(result, "shrink_runs", 0)
    ss, ds = getattr(result, "shrink_s", 0.0), getattr(result, "diagnose_s", 0.0)
    if not (runs or ss or ds):
        return None
    return f"  shrinking: {runs} re-run(s), {ss:.1f}s; diagnosis {ds:.1f}s (not counted as cases)"


def summary_lines(result) -> list[str]:
    """End-of-campaign summary (``harness.campaign.CampaignResult``)."""
    o = result.options
    budget = "no time limit" if o.budget_s is None else f"budget {o.budget_s:g}s"
    lim = "" if o.examples is None else f", example limit {o.examples}"
    lines = [f"mla-fuzz run: backend {o.backend}, graph {o.graph}, spec {o.spec}, seed {o.seed}, "
             f"{result.workers} worker(s), {budget}{lim}" + (" -- INTERRUPTED" if result.interrupted else ""),
             f"  {result.elapsed:.1f}s, {result.examples} cases ({result.rate:.2f}/s), {result.steps} steps, "
             f"{result.chunks} chunks, {result.restarts} worker restart(s)"]
    if getattr(result, "launcher", None):
        lines.append(f"  workers: {result.launcher}")
    if shrink_line(result):
        lines.append(shrink_line(result))
    if getattr(result, "oom_retries", 0):
        lines.append(f"  GPU out of memory: {result.oom_retries} task(s) ran again with fewer beside them "
                     f"(not findings; fewer --workers avoid it)")
    warm = getattr(result, "warmup", None)
    if warm is not None:
        from .warmup import summary_line
        lines.append("  " + summary_line(warm, result.workers))
    specs = getattr(o, "specs", (o.spec,))
    if len(specs) > 1:
        lines.append("  " + specs_line(result.specs_dict()))
    if warm is not None or len(specs) > 1:
        lines.append("  times (found, final) count from the command's start"
                     + (", the warmup included" if warm is not None else ""))
    cov = coverage_parts(result.coverage)
    if cov:
        lines.append("  coverage:")
        lines += [f"    {label:<8} {vals}" for label, vals in cov]
    lines += unsupported_lines(result.unsupported)
    if result.findings:
        n = sum(f.count for f in result.findings.values())
        lines.append(f"failures: {len(result.findings)} distinct ({n} in all); repros in {o.corpus}")
        lines += table(["class", "oracle", "count", "steps", "found", "final", "repro"], finding_rows(result))
    elif result.error_kind is not None:
        lines.append("the campaign could not run (below)")
    else:
        lines.append("no failures found")
    for w in result.warnings:
        lines.append("warning: " + w)
    for e in result.errors:
        lines.append("error: " + e)
    return lines


def specs_line(specs: dict) -> str:
    """``specs (interleaved chunks): tiny 420 cases in 5 chunk(s), max_seq_len 4096; deepseek-v3 ...``."""
    parts = [f"{name} {d.get('examples', 0)} cases in {d.get('chunks', 0)} chunk(s), max_seq_len {d.get('max_seq_len')}"
             for name, d in specs.items()]
    return "specs (interleaved chunks): " + "; ".join(parts)


def unsupported_lines(unsupported: dict) -> list[str]:
    """Scenarios the backend declined, by reason (never findings)."""
    if not unsupported:
        return []
    lines = [f"  unsupported: {sum(unsupported.values())} scenario(s) declined by the backend (not findings):"]
    lines += [f"    {n:>5}  {reason}" for reason, n in sorted(unsupported.items(), key=lambda kv: -kv[1])[:10]]
    if any(r.endswith("(plain NotImplementedError)") for r in unsupported):
        lines.append("    hint: declare what the backend supports (a `capabilities` class attribute, "
                     "docs/backends.md#capabilities) so these are not drawn at all")
    return lines


def _secs(v) -> str:
    return "" if v is None else f"{v:.1f}"


def matrix_rows(rows: list[dict], by_spec: bool = False) -> list[list]:
    """``examples``: to detect (caught) or searched (not caught); ``first sight``: seconds
    from the command's start to the row's first failure, ``final``: to the row's end.
    ``by_spec``: rows at several sizes, each named with its spec."""
    from .matrix import row_label
    out = []
    for r in rows:
        match = r.get("matches")
        out.append([row_label(r, by_spec), "yes" if r["caught"] else "no",
                    r.get("examples_to_detect") if r["caught"] else r.get("examples"),
                    _secs(r.get("seconds_to_detect")), _secs(r.get("seconds")),
                    r.get("diagnosis") or "-",
                    "-" if match is None else ("yes" if match else "NO"),
                    ", ".join(sorted(r.get("expected") or [])) or "-"])
    return out


MATRIX_HEADERS = ["backend", "caught", "examples", "first sight s", "final s", "diagnosis", "expected?",
                  "expected classes"]
