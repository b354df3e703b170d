"""Live campaign progress on stderr: a rich ``Live`` panel on a terminal, otherwise one
plain line every few seconds (CI logs, pipes). ``rich`` is optional.

Shows elapsed/budget, cases/s, failures by diagnosis class, and coverage of the
scenario dimensions (next_n values, KV dtypes incl. FP8, MTP short decode, padded rows,
zero-length rows, ops, layer / FP8 output) from the merged ``FuzzReport.coverage``.
"""
from __future__ import annotations

import sys
import time

from .render import coverage_parts

try:  # rich is optional: the plain display below needs nothing
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text
except Exception:  # pragma: no cover - exercised only where rich is missing
    Console = None


def _status(result, live_examples: int, live_steps: int) -> dict:
    o = result.options
    el = max(result.elapsed, 1e-9)
    ex = result.examples + live_examples
    return {
        "elapsed": result.elapsed,
        "budget": "" if o.budget_s is None else f"/{o.budget_s:g}s",
        "examples": ex, "steps": result.steps + live_steps, "rate": ex / el,
        "limit": "" if o.examples is None else f"/{o.examples}",
        "failures": ", ".join(f"{c} {n}" for c, n in sorted(result.failures.items())) or "none",
        "distinct": len(result.findings),
    }


class PlainProgress:
    """A line every ``interval`` seconds and one per note."""

    def __init__(self, stream=None, interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.interval = interval
        self._last = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def note(self, text: str) -> None:
        print(f"[mla-fuzz] {text}", file=self.stream, flush=True)

    def update(self, result, live_examples: int = 0, live_steps: int = 0, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        s = _status(result, live_examples, live_steps)
        cov = dict(coverage_parts(result.coverage))
        covtxt = " | ".join(f"{k} {cov[k]}" for k in ("next_n", "kv", "MTP", "padding", "longest", "split") if k in cov)
        print(f"[mla-fuzz] {s['elapsed']:.0f}s{s['budget']} {result.state}: {s['examples']}{s['limit']} cases "
              f"({s['rate']:.2f}/s), {s['steps']} steps, failures: {s['failures']}"
              + (f" | {covtxt}" if covtxt else ""), file=self.stream, flush=True)


class RichProgress:
    """A ``rich.live.Live`` panel redrawn four times a second."""

    def __init__(self, stream=None):
        self.console = Console(file=stream or sys.stderr)
        self._live = Live(console=self.console, refresh_per_second=4, transient=False)
        self._args = None

    def __enter__(self):
        self._live.__enter__()
        return self

    def __exit__(self, *exc):
        return self._live.__exit__(*exc)

    def note(self, text: str) -> None:
        self.console.print(Text(text), style="bold red" if "->" in text else None)

    def update(self, result, live_examples: int = 0, live_steps: int = 0, force: bool = False) -> None:
        s = _status(result, live_examples, live_steps)
        head = Table.grid(padding=(0, 2))
        head.add_row("time", f"{s['elapsed']:.1f}s{s['budget']}  ({result.state})")
        head.add_row("cases", f"{s['examples']}{s['limit']}  ({s['rate']:.2f}/s), {s['steps']} steps, "
                              f"{result.chunks} chunks, {result.workers} worker(s)")
        head.add_row("failures", Text(s["failures"], style="bold red" if result.failures else "green"))
        cov = Table.grid(padding=(0, 2))
        for label, vals in coverage_parts(result.coverage):
            cov.add_row(Text(label, style="cyan"), vals)
        self._live.update(Group(head, cov))


def make_progress(enabled: bool = True, stream=None):
    """The display for a campaign: rich when ``stream`` (default stderr) is a terminal and
    rich imports, plain lines otherwise, or ``None`` when disabled."""
    if not enabled:
        return None
    stream = stream or sys.stderr
    if Console is not None and getattr(stream, "isatty", lambda: False)():
        return RichProgress(stream)
    return PlainProgress(stream)
