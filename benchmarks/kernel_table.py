"""Markdown tables of a ``kernel_bench.py`` grid (its json), for ``docs/kernel-performance.md``.

Two tables, both computed from the json's case records (never typed by hand):

- the headlines against issue 3's targets (``kernel_bench.summarize``, plus how many cases meet
  each target);
- every case: the median replay time, its ratio to the roofline bound, and for the h=16 cases of
  B·L >= 128k tokens the share of the copy bandwidth; a cell in bold misses its target (h=16
  under 75% of the copy rate at B·L >= 128k, any case over 2x its roofline at B >= 32).

``--against OLD.json`` adds, per (kv, h, s_q), the geo-mean and range of OLD's time over this
one's (separate commands: only shifts beyond a few percent mean anything). ``--write FILE.md``
replaces the body of each block between ``<!-- kernel-table: PATH -->`` and ``<!-- /kernel-table
-->`` with the tables of PATH, and of each ``<!-- design-floor: PATH -->`` block with
``design_floor.table`` of that run; ``--check FILE.md`` exits 1 when a block is not what its
json gives (``tests/kernels/test_kernel_table.py`` runs it on docs/kernel-performance.md).

    python benchmarks/kernel_table.py benchmarks/results/h100-2026-11-27-kernel-32.json
    python benchmarks/kernel_table.py --write docs/kernel-performance.md   # the json each marker names
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys

#: issue 3's targets
BW_TARGET = 0.75
FLOP_TARGET = 0.40
ROOF_TARGET = 2.0
MEM_TOKENS = 128 * 1024
BIG_BATCH = 32

#: README blocks this tool writes, by marker name: ``<!-- NAME: PATH -->`` ... ``<!-- /NAME -->``
#: (``kernel-table``: a kernel_bench grid; ``design-floor``: a design_floor.py run)
_BEGIN = re.compile(r"<!-- (?P<name>kernel-table|design-floor): (?P<path>\S+) -->\n")


class TableError(ValueError):
    """A json that is not a kernel_bench grid, or a README without the marker (a one-line message)."""


def load_grid(path: str) -> dict:
    """A kernel_bench json (``results``: its case records) read from ``path``; TableError when the
    file is missing, not json, or has no case records."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise TableError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TableError(f"{path} is not json: {e}") from None
    need = {"kv", "h", "s_q", "B", "L", "time_us", "x_roofline", "bw_ratio", "flop_ratio"}
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not rows or not all(isinstance(r, dict) and need <= r.keys() for r in rows):
        raise TableError(f"{path} is not a kernel_bench grid (no 'results' with {sorted(need)})")
    return doc


def _summarize(results: list) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_bench import summarize
    return summarize(results)


def _mem_case(r: dict) -> bool:
    return r["h"] == 16 and r["B"] * r["L"] >= MEM_TOKENS


def misses_target(r: dict) -> bool:
    """Whether case record ``r`` misses one of issue 3's per-case targets: an h=16 case of
    B·L >= 128k tokens under 75% of the copy rate, or a case of B >= 32 over 2x its roofline."""
    return (_mem_case(r) and r["bw_ratio"] < BW_TARGET) or (r["B"] >= BIG_BATCH and r["x_roofline"] > ROOF_TARGET)


def target_limits_us(h: int, B: int, L: int, io_bytes: float, roofline_us: float, copy_tbps: float) -> dict:
    """The longest time (us) each of issue 3's per-case targets allows a case (``io_bytes`` read
    and written, ``roofline_us`` its bound, ``copy_tbps`` the copy rate measured beside it), for
    the targets that apply to it: ``copy_share`` (h=16 at B·L >= 128k tokens: the bytes at 75%
    of the copy rate) and ``x_roofline`` (B >= 32: twice the roofline). The times at which
    ``misses_target`` flips."""
    lim = {}
    if h == 16 and B * L >= MEM_TOKENS:
        lim["copy_share"] = io_bytes / (BW_TARGET * copy_tbps * 1e12) * 1e6
    if B >= BIG_BATCH:
        lim["x_roofline"] = ROOF_TARGET * roofline_us
    return lim


def headline_table(doc: dict) -> str:
    """The headline figures of grid ``doc`` against the targets, as a markdown table."""
    res = doc["results"]
    s = _summarize(res)
    mem = [r for r in res if _mem_case(r)]
    comp = [r for r in res if r["h"] == 128 and r["s_q"] == 2]
    big = [r for r in res if r["B"] >= BIG_BATCH]

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    rows = [
        ("h=16, B·L >= 128k: min / median share of copy bandwidth",
         f"{pct(s['mem_bound_h16_BL>=128k_min_bw_ratio'])} / {pct(s['mem_bound_h16_BL>=128k_median_bw_ratio'])} "
         f"({sum(r['bw_ratio'] >= BW_TARGET for r in mem)} of {len(mem)} cases >= {BW_TARGET:.0%})",
         f">= {BW_TARGET:.0%}"),
        ("h=128, s_q=2: max / median share of matmul peak",
         f"{pct(s['h128_sq2_max_flop_ratio'])} / {pct(s['h128_sq2_median_flop_ratio'])}",
         f">= {FLOP_TARGET:.0%}"),
        ("B >= 32: worst time over roofline",
         "-" if s["B>=32_worst_x_roofline"] is None else
         f"{s['B>=32_worst_x_roofline']:.2f}x ({sum(r['x_roofline'] > ROOF_TARGET for r in big)} of {len(big)} "
         f"cases over {ROOF_TARGET:g}x)",
         f"<= {ROOF_TARGET:g}x"),
    ]
    head = f"| headline ({doc.get('gpu', '?')}, clean-flush replays) | measured | target |\n| --- | --- | --- |\n"
    return head + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)


def _cell(r) -> str:
    if r is None:
        return "-"
    text = f"{r['time_us']:.1f} µs, {r['x_roofline']:.2f}x"
    if _mem_case(r):
        text += f", {r['bw_ratio']:.1%}"  # one decimal: 74.9% must not read as the 75% it misses
    return f"**{text}**" if misses_target(r) else text


def case_table(doc: dict) -> str:
    """Every case of grid ``doc``: rows (kv, h, s_q, B), columns L; a cell is the replay time, the
    ratio to the roofline bound and (h=16 at B·L >= 128k) the share of copy bandwidth, in bold
    when it misses its target."""
    res = doc["results"]
    lens = sorted({r["L"] for r in res})
    at = {(r["kv"], r["h"], r["s_q"], r["B"], r["L"]): r for r in res}
    keys = sorted({k[:4] for k in at}, key=lambda k: (k[0], k[1], k[2], k[3]))
    head = "| kv | h | s_q | B | " + " | ".join(f"L={L // 1024}k" if L % 1024 == 0 else f"L={L}" for L in lens)
    lines = [head + " |", "| --- | --- | --- | --- | " + " | ".join("---" for _ in lens) + " |"]
    for k in keys:
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " +
                     " | ".join(_cell(at.get(k + (L,))) for L in lens) + " |")
    return "\n".join(lines) + "\n"


def compare_table(doc: dict, base: dict) -> str:
    """Per (kv, h, s_q): geo-mean and range of ``base``'s time over ``doc``'s for the cases both
    grids hold (>1: ``doc`` faster)."""
    b = {(r["kv"], r["h"], r["s_q"], r["B"], r["L"]): r["time_us"] for r in base["results"]}
    groups: dict = {}
    for r in doc["results"]:
        k = (r["kv"], r["h"], r["s_q"], r["B"], r["L"])
        if k in b:
            groups.setdefault(k[:3], []).append(b[k] / r["time_us"])
    lines = ["| kv | h | s_q | cases | old / new, geo-mean | range |", "| --- | --- | --- | --- | --- | --- |"]
    for g in sorted(groups):
        xs = groups[g]
        geo = math.exp(statistics.fmean(math.log(x) for x in xs))
        lines.append(f"| {g[0]} | {g[1]} | {g[2]} | {len(xs)} | {geo:.3f} | {min(xs):.3f}-{max(xs):.3f} |")
    return "\n".join(lines) + "\n"


def render(path: str, name: str = "kernel-table") -> str:
    """A README block's body for the json at ``path``: for ``kernel-table`` (a grid) the headline
    table, then every case; for ``design-floor`` ``design_floor.table`` of that run."""
    if name == "design-floor":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import design_floor
        return design_floor.table(design_floor.load_run(path))
    doc = load_grid(path)
    return headline_table(doc) + "\n" + case_table(doc)


def readme_blocks(text: str) -> list:
    """``[(name, path, start, end), ...]`` of the README's blocks (``_BEGIN``), in order: the
    marker's name, the json it names and the span of its body (between the two markers);
    TableError when there is none, or a block has no closing marker."""
    blocks = []
    for m in _BEGIN.finditer(text):
        close = f"<!-- /{m.group('name')} -->"
        end = text.find(close, m.end())
        if end < 0:
            raise TableError(f"no '{close}' after the {m.group('name')} marker")
        blocks.append((m.group("name"), m.group("path"), m.end(), end))
    if not blocks:
        raise TableError("no '<!-- kernel-table: PATH -->' marker")
    return blocks


def _kind(path: str) -> str:
    # the marker name a json's block takes: a design_floor run or (else) a grid
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError):
        return "kernel-table"  # render() reports what is wrong with it
    return "design-floor" if isinstance(doc, dict) and "cases" in doc and "results" not in doc else "kernel-table"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid", nargs="?",
                    help="a kernel_bench json (default with --write/--check: the one the marker names)")
    ap.add_argument("--against", help="an older grid's json: per-group speed ratios")
    ap.add_argument("--write", metavar="README", help="rewrite the README's blocks from the json each names (with a "
                    "json given, the block of its kind names it first)")
    ap.add_argument("--check", metavar="README", help="exit 1 when a README block is not what its json gives")
    args = ap.parse_args(argv)
    try:
        readme = args.write or args.check
        if readme:
            try:
                with open(readme) as f:
                    text = f.read()
            except OSError as e:
                raise TableError(f"cannot read {readme}: {e.strerror}") from None

            def resolve(p):
                if not os.path.isabs(p) and not os.path.exists(p):
                    return os.path.join(os.path.dirname(os.path.abspath(readme)), p)
                return p

            if args.grid and args.write:  # the first block of the json's kind now names it
                kind = _kind(args.grid)
                m = next((m for m in _BEGIN.finditer(text) if m.group("name") == kind), None)
                if m is None:
                    raise TableError(f"no '<!-- {kind}: PATH -->' marker")
                text = text[:m.start()] + f"<!-- {kind}: {args.grid} -->\n" + text[m.end():]
            stale = []
            for name, path, start, end in reversed(readme_blocks(text)):
                body = render(resolve(args.grid if args.grid and args.check and name == _kind(args.grid) else path),
                              name)
                if text[start:end] != body:
                    stale.append(f"{name} ({path})")
                    text = text[:start] + body + text[end:]
            if args.check:
                if stale:
                    print(f"kernel_table: {readme}'s {', '.join(reversed(stale))} block is not what its json gives; "
                          f"run: python benchmarks/kernel_table.py --write {readme}", file=sys.stderr)
                    return 1
                return 0
            with open(readme, "w") as f:
                f.write(text)
            return 0
        if not args.grid:
            ap.error("a grid json is needed (or --write / --check README)")
        out = render(args.grid)
        if args.against:
            out += "\n" + compare_table(load_grid(args.grid), load_grid(args.against))
        sys.stdout.write(out)
        return 0
    except TableError as e:
        print(f"kernel_table: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
