"""benchmarks/kernel_table.py: the kernel tables of docs/kernel-performance.md come from a benchmark json,
and stay so."""
from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DOC = os.path.join(ROOT, "docs", "kernel-performance.md")


def _case(kv="bf16", h=16, s_q=1, B=8, L=16384, t=100.0, x=1.5, bw=0.8, flop=0.1, **more):
    r = dict(kv=kv, h=h, s_q=s_q, B=B, L=L, time_us=t, x_roofline=x, bw_ratio=bw, flop_ratio=flop,
             roofline_us=t / x, time_us_do_bench=t, read_ref_bw_ratio=bw, x_read_ref=1.0, read_floor_bw_ratio=bw,
             x_read_floor=1.0, read_floor_us=t / 2)
    r.update(more)
    return r


def test_doc_kernel_tables_are_the_json_they_name(load_benchmark):
    """The kernel and design-floor blocks of docs/kernel-performance.md are exactly what their
    markers' json gives: a new run, or an edited table, fails here until ``kernel_table.py --write
    docs/kernel-performance.md`` is run."""
    kt = load_benchmark("kernel_table")
    with open(DOC) as f:
        text = f.read()
    blocks = kt.readme_blocks(text)
    assert {name for name, *_ in blocks} == {"kernel-table", "design-floor"}
    for name, path, start, end in blocks:
        assert os.path.exists(os.path.join(ROOT, path)), path
        assert text[start:end] == kt.render(os.path.join(ROOT, path), name)
    assert kt.main(["--check", DOC]) == 0


def test_summary_recomputed_from_the_cases_matches_the_benchmark_run(load_benchmark):
    """``kernel_bench.summarize`` (which the table's headlines use) gives, from a committed grid's
    case records, the summary that run wrote."""
    kb = load_benchmark("kernel_bench")
    with open(os.path.join(ROOT, "benchmarks", "results", "h100-2026-11-27-kernel-32.json")) as f:
        doc = json.load(f)
    assert kb.summarize(doc["results"]) == pytest.approx(doc["summary"])


def test_bold_cells_are_exactly_the_cases_missing_a_target(load_benchmark):
    """Bold marks an h=16 case of B·L >= 128k under 75% of the copy rate, or a B >= 32 case over 2x
    its roofline, and nothing else: the boundaries themselves are not misses."""
    kt = load_benchmark("kernel_table")
    doc = {"gpu": "G", "results": [
        _case(B=8, L=16384, bw=0.749, x=1.3),          # h=16, 128k tokens, under 75%: bold
        _case(B=8, L=32768, bw=0.75, x=1.3),           # exactly 75%: met
        _case(B=8, L=4096, bw=0.30, x=1.9),            # 32k tokens: the share is not a target there
        _case(B=32, L=1024, bw=0.30, x=2.01),          # B >= 32 over 2x: bold
        _case(B=32, L=2048, bw=0.30, x=2.0),           # exactly 2x: met
        _case(h=128, B=8, L=1024, x=9.0),              # B < 32: no roofline target
    ]}
    table = kt.case_table(doc)
    bold = [line for line in table.splitlines() if "**" in line]
    assert len(bold) == 2
    assert "**100.0 µs, 1.30x, 74.9%**" in table.splitlines()[2]
    assert table.count("**") == 4
    assert "**100.0 µs, 2.01x**" in table
    assert "100.0 µs, 2.00x |" in table and "100.0 µs, 9.00x" in table
    head = kt.headline_table(doc)
    assert "(1 of 2 cases >= 75%)" in head and "(1 of 2 cases over 2x)" in head


def test_check_flags_a_stale_block_and_write_mends_it(load_benchmark, tmp_path):
    kt = load_benchmark("kernel_table")
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"gpu": "G", "results": [_case(), _case(B=32, L=1024, x=3.0)]}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n<!-- kernel-table: {grid} -->\n| old | table |\n<!-- /kernel-table -->\nafter\n")
    assert kt.main(["--check", str(readme)]) == 1
    assert kt.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith("<!-- /kernel-table -->\nafter\n")
    assert "| old | table |" not in text and "**100.0 µs, 3.00x**" in text
    assert kt.main(["--check", str(readme)]) == 0
    # another grid named on the command line: the marker follows it
    other = tmp_path / "h.json"
    other.write_text(json.dumps({"gpu": "H", "results": [_case(t=50.0)]}))
    assert kt.main([str(other), "--write", str(readme)]) == 0
    assert f"<!-- kernel-table: {other} -->" in readme.read_text() and kt.main(["--check", str(readme)]) == 0


def test_design_floor_blocks_are_checked_and_written_beside_the_kernel_table(load_benchmark, tmp_path):
    """A ``design-floor`` block is rendered from its run by ``design_floor.table``; ``--check``
    flags it when stale, ``--write`` mends it, and a run named on the command line moves that
    block's marker and no other."""
    kt = load_benchmark("kernel_table")
    df = load_benchmark("design_floor")
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"gpu": "G", "results": [_case()]}))
    run = {"gpu": "G", "cases": [{"case": ["fp8", 16, 1, 32, 1024], "shipped_us": 25.0, "design_floor_us": 18.0,
                                  "design_floor_any_kernels_us": 14.0, "target_limits_us": {"x_roofline": 15.0}}]}
    floor = tmp_path / "f.json"
    floor.write_text(json.dumps(run))
    readme = tmp_path / "README.md"
    readme.write_text(f"<!-- kernel-table: {grid} -->\n<!-- /kernel-table -->\nmid\n"
                      f"<!-- design-floor: {floor} -->\nold\n<!-- /design-floor -->\nend\n")
    assert kt.main(["--check", str(readme)]) == 1
    assert kt.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert df.table(run) in text and kt.render(str(grid)) in text and text.endswith("<!-- /design-floor -->\nend\n")
    assert kt.main(["--check", str(readme)]) == 0
    run["cases"][0]["shipped_us"] = 24.0
    other = tmp_path / "f2.json"
    other.write_text(json.dumps(run))
    assert kt.main([str(other), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert f"<!-- design-floor: {other} -->" in text and f"<!-- kernel-table: {grid} -->" in text
    assert "| 24.0 µs |" in text and kt.main(["--check", str(readme)]) == 0


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "is not json"),
    (json.dumps({"results": [{"kv": "bf16"}]}), "is not a kernel_bench grid"),
])
def test_bad_input_is_one_line_and_exit_2(load_benchmark, tmp_path, capsys, content, message):
    kt = load_benchmark("kernel_table")
    path = tmp_path / "g.json"
    if content is not None:
        path.write_text(content)
    assert kt.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_readme_without_marker_is_exit_2(load_benchmark, tmp_path, capsys):
    kt = load_benchmark("kernel_table")
    readme = tmp_path / "README.md"
    readme.write_text("# nothing here\n")
    assert kt.main(["--check", str(readme)]) == 2
    assert "no '<!-- kernel-table: PATH -->' marker" in capsys.readouterr().err


def test_against_gives_per_group_ratios(load_benchmark, tmp_path, capsys):
    kt = load_benchmark("kernel_table")
    new = {"gpu": "G", "results": [_case(t=100.0), _case(B=32, t=50.0), _case(kv="fp8", t=10.0)]}
    old = {"gpu": "G", "results": [_case(t=110.0), _case(B=32, t=40.0)]}
    table = kt.compare_table(new, old)
    row = [line for line in table.splitlines() if line.startswith("| bf16 |")]
    # geo-mean of 1.1 and 0.8, range 0.800-1.100; the fp8 case has no old time and no row
    assert row == ["| bf16 | 16 | 1 | 2 | 0.938 | 0.800-1.100 |"]
    assert "fp8" not in table
