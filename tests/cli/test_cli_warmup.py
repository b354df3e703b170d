"""Pay compilation once, fuzz both sizes (issue #44 items 1 and 3): the warmup's scenario list
spans what the search draws, ``mla-fuzz warmup`` runs it on worker processes and leaves a
marker that makes the next one a no-op, ``run`` reports the warmup phase, and a campaign of
two specs alternates them by chunk. On CPU the kernels are interpreted (nothing compiles):
these tests check the machinery, with the scope narrowed to two scenarios; the GPU test at
the end checks the cold and warm cache on a real device."""
from __future__ import annotations

import argparse
import itertools
import json
import time

import pytest

from mla_fuzz.harness import cli, narrowing
from mla_fuzz.harness.campaign import CampaignOptions, CampaignRun, chunk_seed, chunk_spec
from mla_fuzz.harness.fuzz import default_max_seq_len
from mla_fuzz.harness.loading import load_backend
from mla_fuzz.harness.scenario import ScenarioConfig, outside_capabilities
from mla_fuzz.harness.strategies import PATHS, TINY_HEADS, scenario_lengths
from mla_fuzz.harness.warmup import MARKER_DIR, dimensions, pairwise, plan_scenarios, prepare
from mla_fuzz.mla_ref import ModelSpec
from cli_helpers import one_line, run_cli

#: two scenarios: one KV format, one head count, one next_n, one page size, the attention path
NARROW = ["--kv-dtypes", "bf16", "--heads", "1", "--next-n", "1", "--page-sizes", "16", "--no-sparse", "--no-layer"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh Triton cache folder for this process and the workers it starts."""
    d = tmp_path / "triton-cache"
    d.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(d))
    return d


# -- the scenario list ------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[4, 10, 5, 3, 2], [4, 2, 5, 1, 2], [1, 1, 1, 1, 2], [3], [2, 2]])
def test_pairwise_covers_every_pair_of_values(sizes):
    rows = pairwise(sizes)
    for i, j in itertools.combinations(range(len(sizes)), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(range(sizes[i]), range(sizes[j])))
    assert rows == pairwise(sizes)  # deterministic
    if len(sizes) > 1:  # the greedy reaches the lower bound here
        a, b = sorted(sizes)[-2:]
        assert len(rows) == a * b


def test_tiny_plan_spans_what_the_search_draws():
    cls = load_backend("triton")
    plan = plan_scenarios(cls, "tiny", "cuda")
    cfgs = [ScenarioConfig.from_dict(dict(s.config)) for s in plan]
    assert len(plan) == 50 and len({s.name for s in plan}) == 50
    assert {c.kv_dtype for c in cfgs} == {"bf16", "fp16", "fp8", "fp8_e4m3"}
    assert {(c.kv_dtype, c.q_dtype) for c in cfgs} == {("bf16", "bf16"), ("fp16", "fp16"), ("fp8", "bf16"),
                                                       ("fp8_e4m3", "bf16")}
    assert {ModelSpec.from_dict(c.spec).num_heads for c in cfgs} == set(TINY_HEADS)
    assert {c.next_n for c in cfgs} == {1, 4}
    assert {c.path for c in cfgs} == set(PATHS) | {"sparse+indexer"}
    assert {c.page_size for c in cfgs} == {4, 16, 64}
    assert max(c.max_seq_len for c in cfgs) == default_max_seq_len("tiny", "cuda")
    assert min(c.max_seq_len for c in cfgs) < 128
    caps = cls.capabilities
    for s, c in zip(plan, cfgs):
        assert outside_capabilities(c, s.steps, caps) is None
        ops = [st["op"] for st in s.steps]
        assert ops[:2] == ["capture", "capture"] and "replay" in ops and "eager" in ops
        # the long rows reach the scenario's length (split kernels), short ones stay short
        assert max(max(st["batch"]["seq_lens"]) for st in s.steps) == c.max_seq_len
    # every (head count, next_n) with every path: each query-row count on each kernel
    assert {(ModelSpec.from_dict(c.spec).num_heads, c.next_n, c.path) for c in cfgs} >= {
        (h, n, p) for h in TINY_HEADS for n in (1, 4) for p in ("attention",)}


def test_deepseek_plan_and_narrowing():
    cls = load_backend("triton")
    plan = plan_scenarios(cls, "deepseek-v3", "cuda")
    assert len(plan) == 20
    cfgs = [s.config for s in plan]
    assert {c["page_size"] for c in cfgs} == {64}
    assert {c["max_pages_per_seq"] for c in cfgs} == {1, 8, 512}
    # one head count: every next_n the search draws, each on every data path (the query rows
    # per request set the launch's row blocks, part count and partial-buffer rows)
    paths = {ScenarioConfig.from_dict(dict(c)).path for c in cfgs}
    assert {(c["next_n"], ScenarioConfig.from_dict(dict(c)).path) for c in cfgs} == {
        (n, p) for n in cls.capabilities.next_n for p in paths}
    assert set(cls.capabilities.next_n) == {1, 2, 3, 4} and paths == set(PATHS) | {"sparse+indexer"}
    assert max(c["max_pages_per_seq"] * 64 for c in cfgs) == default_max_seq_len("deepseek-v3", "cuda")
    # the user's narrowing and --max-seq-len shape the list (and so the marker's key)
    narrow = narrowing.parse({"kv_dtypes": "bf16", "heads": "1", "next_n": "1", "page_sizes": "16",
                                  "no_sparse": True, "no_layer": True})
    small = plan_scenarios(cls, "tiny", "cpu", narrow, max_seq_len=100)
    assert len(small) == 2 and {s.config["max_pages_per_seq"] * 16 for s in small} == {32, 96}
    dims, _ = dimensions(cls, "tiny", "cpu", narrow)
    assert [len(v) for _, v in dims] == [1, 1, 1, 1, 2]


def _stride_classes(pages_per_seq) -> set:
    return {"one" if n == 1 else "multiple of 16" if n % 16 == 0 else "neither" for n in pages_per_seq}


@pytest.mark.parametrize("spec", ["tiny", "deepseek-v3"])
def test_plan_reaches_every_specialization_class_the_search_draws(spec):
    """Triton compiles a variant per class of an integer argument (1, a multiple of 16,
    neither), and the block table's row stride is a scenario's pages per sequence: every class
    the search draws is in the plan (at DeepSeek-V3 size, 64-token pages only, the shortest and
    longest scenarios are 1 and 512 pages, and the search's 2- and 8-page ones were compiled by
    each worker on its own)."""
    cls = load_backend("triton")
    plan = plan_scenarios(cls, spec, "cuda")
    pages = (64,) if spec == "deepseek-v3" else (4, 16, 64)
    drawn = {max(1, n // p) for n in scenario_lengths(default_max_seq_len(spec, "cuda")) for p in pages}
    assert _stride_classes(drawn) == {"one", "multiple of 16", "neither"}
    assert _stride_classes(s.config["max_pages_per_seq"] for s in plan) >= _stride_classes(drawn)


def test_marker_key_follows_the_plan(cache):
    narrow = {"kv_dtypes": ["bf16"], "next_n": [1], "sparse": False, "layer": False}
    a = prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow)
    b = prepare("triton", ["tiny"], "emulated", gpu=False, narrow={**narrow, "heads": [1]})
    c = prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow, max_seq_len=64)
    paths = {a.specs[0].marker, b.specs[0].marker, c.specs[0].marker}
    assert len(paths) == 3 and all(p.parent == cache / MARKER_DIR for p in paths)
    assert not a.warm and a.specs[0].key["device"] == "cpu" and a.specs[0].key["backend"] == "triton"
    assert {"torch", "triton", "sources", "plan", "graph", "spec"} <= set(a.specs[0].key)


# -- the command --------------------------------------------------------------------------------
def test_warmup_command_runs_once_then_is_warm(tmp_path, cache, capsys):
    report = tmp_path / "w.json"
    code, out, err = run_cli(["warmup", "--graph", "emulated", "--spec", "tiny", *NARROW, "--workers", "2",
                              "--json", str(report)], capsys)
    assert code == 0, out + err
    first = json.loads(report.read_text())
    assert first["warm"] is False and first["scenarios"] == first["planned"] == 2 and first["completed"]
    assert first["warnings"] == [] and first["failed"] == 0 and first["cache_dir"] == str(cache)
    assert first["seconds"] > 0 and first["specs"]["tiny"]["ran"] == 2
    assert "warmup: 2 scenario(s) in" in out and str(cache) in out
    assert "warmup 2/2 scenarios" in err
    marker = json.loads((cache / MARKER_DIR).joinpath(next(p.name for p in (cache / MARKER_DIR).iterdir()))
                        .read_text())
    assert marker["scenarios"] == 2 and marker["key"]["spec"] == "tiny"

    t0 = time.monotonic()
    code, out, err = run_cli(["warmup", "--graph", "emulated", "--spec", "tiny", *NARROW, "--json", str(report)],
                             capsys)
    assert code == 0, out + err
    again = json.loads(report.read_text())
    assert again["warm"] is True and again["scenarios"] == 0 and again["check_s"] < 1.0
    assert "nothing to do" in out and time.monotonic() - t0 < 10  # no worker was started
    # --force runs it again
    code, out, _ = run_cli(["warmup", "--graph", "emulated", "--spec", "tiny", *NARROW, "--force", "--quiet",
                            "--workers", "1", "--json", str(report)], capsys)
    assert code == 0 and json.loads(report.read_text())["scenarios"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["warmup", "--spec", "huge"], "invalid choice"),
    (["warmup", "--workers", "many"], "--workers"),
    (["warmup", "--graph", "tpu"], "invalid choice"),
    (["warmup", "--max-seq-len", "0"], "--max-seq-len"),
    (["warmup", "--kv-dtypes", "int4"], "--kv-dtypes"),
    (["warmup", "--case-timeout", "soon"], "--case-timeout"),
    (["warmup", "--backend", "no_such_module_xyz:Backend"], "no_such_module_xyz"),
    (["warmup", "--json", "missing-folder/w.json"], "--json"),
    (["run", "--warmup", "--no-warmup"], "not allowed with"),
    (["mutants", "--warmup", "--no-warmup"], "not allowed with"),
])
def test_bad_warmup_flags_are_one_line(argv, needle, tmp_path, cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    line = one_line(err)
    assert "error" in line and needle in line


def test_warmup_is_on_by_default_on_a_gpu_only(cache):
    args = argparse.Namespace(warmup=False, no_warmup=False)
    assert cli._warmup_plan(args, "triton", ["tiny"], "emulated", {}, None) is None
    assert cli._warmup_plan(argparse.Namespace(warmup=False, no_warmup=True), "triton", ["tiny"], "cuda", {},
                            None) is None
    plan = cli._warmup_plan(argparse.Namespace(warmup=True, no_warmup=False), "triton", ["tiny"], "emulated",
                            {"kv_dtypes": ["bf16"]}, None)
    assert plan is not None and [s.spec for s in plan.specs] == ["tiny"]


def test_run_reports_the_warmup_phase(tmp_path, cache, capsys):
    report = tmp_path / "r.json"
    base = ["run", "--graph", "emulated", *NARROW, "--seed", "1", "--quiet", "--corpus", str(tmp_path / "c"),
            "--json", str(report)]
    code, out, err = run_cli(base + ["--warmup", "--examples", "2", "--workers", "2"], capsys)
    assert code == 0, out + err
    rep = json.loads(report.read_text())
    assert rep["warm"] is False and rep["warmup_scenarios"] == 2 and rep["warmup_s"] > 0
    assert rep["warmup"]["completed"] and rep["warmup"]["specs"]["tiny"]["ran"] == 2
    assert "command's start" in rep["clock"] and "warmup" in rep["clock"]
    # the warmup is inside the campaign's clock, which counts from the command's start
    assert rep["elapsed_s"] >= rep["warmup_s"] + rep["setup_s"] - 0.5
    assert rep["examples"] == 2 and rep["specs"] == {"tiny": {"examples": 2, "steps": rep["steps"], "chunks": 1,
                                                               "max_seq_len": 512}}
    assert "warmup: 2 scenario(s) in" in out and "the warmup included" in out

    code, out, err = run_cli(base + ["--warmup", "--examples", "1"], capsys)
    assert code == 0, out + err
    rep = json.loads(report.read_text())
    assert rep["warm"] is True and rep["warmup_scenarios"] == 0 and rep["warmup_s"] == 0
    assert "nothing to do" in out

    # without --warmup on CPU: no phase at all
    code, out, err = run_cli(base + ["--examples", "1"], capsys)
    rep = json.loads(report.read_text())
    assert code == 0 and rep["warm"] is None and rep["warmup"] is None and "  warmup:" not in out


# -- both sizes ---------------------------------------------------------------------------------
def test_chunk_spec_alternates():
    specs = ("tiny", "deepseek-v3")
    assert [chunk_spec(specs, k) for k in range(5)] == ["tiny", "deepseek-v3", "tiny", "deepseek-v3", "tiny"]
    assert {chunk_spec(("tiny",), k) for k in range(4)} == {"tiny"}


@pytest.mark.parametrize("shard", [(0, 1), (1, 3)])
def test_campaign_chunks_take_turns_between_specs(shard):
    opts = CampaignOptions(spec="tiny,deepseek-v3", budget_s=None, examples=1000, chunk=10, seed=7, shard=shard)
    run = CampaignRun(opts)
    tasks = [run._next_task() for _ in range(6)]
    ks = [t["chunk"] for t in tasks]
    assert ks == [shard[0] + shard[1] * j for j in range(6)]
    assert [t["spec"] for t in tasks] == [("tiny", "deepseek-v3")[k % 2] for k in ks]
    assert [t["seed"] for t in tasks] == [chunk_seed(7, k) for k in ks]  # seeds as in a one-spec campaign
    assert opts.specs == ("tiny", "deepseek-v3")


def test_spec_defaults():
    assert cli._specs(None, "cuda") == ("tiny", "deepseek-v3")     # a GPU: both sizes
    assert cli._specs(None, "emulated") == ("tiny",)               # CPU: tiny
    assert cli._specs("both", "emulated") == ("tiny", "deepseek-v3")
    assert cli._specs("deepseek-v3", "cuda") == ("deepseek-v3",)   # --spec narrows it


def test_report_gives_examples_and_max_seq_len_per_spec():
    opts = CampaignOptions(spec="tiny,deepseek-v3", graph="cuda")
    run = CampaignRun(opts)
    run.result.count_spec("tiny", 30, 90, 1)
    run.result.count_spec("deepseek-v3", 4, 12, 1)
    specs = run.result.to_dict()["specs"]
    assert specs == {"tiny": {"examples": 30, "steps": 90, "chunks": 1, "max_seq_len": 4096},
                     "deepseek-v3": {"examples": 4, "steps": 12, "chunks": 1, "max_seq_len": 32768}}
    opts.max_seq_len = 2048  # --max-seq-len applies to both
    assert {d["max_seq_len"] for d in run.result.to_dict()["specs"].values()} == {2048}
    from mla_fuzz.harness.render import summary_lines
    text = "\n".join(summary_lines(run.result))
    assert "specs (interleaved chunks): tiny 30 cases in 1 chunk(s), max_seq_len 2048; deepseek-v3 4 cases" in text


def test_a_short_cpu_campaign_of_both_specs(tmp_path, capsys):
    report = tmp_path / "r.json"
    code, out, err = run_cli(["run", "--graph", "emulated", "--spec", "both", "--kv-dtypes", "bf16", "--next-n", "1",
                              "--page-sizes", "64", "--no-sparse", "--no-layer", "--max-seq-len", "64",
                              "--examples", "2", "--chunk", "1",
                              "--seed", "3", "--quiet", "--corpus", str(tmp_path / "c"), "--json", str(report)],
                             capsys)
    assert code == 0, out + err
    rep = json.loads(report.read_text())
    assert rep["spec"] == "tiny,deepseek-v3" and rep["chunks_run"] == [[0, chunk_seed(3, 0)], [1, chunk_seed(3, 1)]]
    assert {s: d["examples"] for s, d in rep["specs"].items()} == {"tiny": 1, "deepseek-v3": 1}
    assert rep["coverage"]["spec"] == {"tiny": 1, "deepseek-v3": 1}
    assert "spec tiny,deepseek-v3 (interleaved chunks)" in err and "specs (interleaved chunks)" in out


# -- on a GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_warmup_cold_then_warm(tmp_path, cache, capsys):
    """Cold: every scenario runs (compiles) without a warning and Triton's cache fills; warm:
    nothing to do; a campaign after it skips its warmup phase."""
    report = tmp_path / "w.json"
    code, out, err = run_cli(["warmup", "--graph", "cuda", "--spec", "tiny", "--json", str(report)], capsys)
    assert code == 0, out + err
    rep = json.loads(report.read_text())
    assert rep["warm"] is False and rep["scenarios"] == 50 and rep["warnings"] == [], rep["warnings"]
    assert sum(1 for p in cache.rglob("*") if p.is_file()) > 10  # compiled kernels
    code, out, _ = run_cli(["warmup", "--graph", "cuda", "--spec", "tiny", "--json", str(report)], capsys)
    assert code == 0 and json.loads(report.read_text())["warm"] is True
    run_json = tmp_path / "r.json"
    code, out, err = run_cli(["run", "--graph", "cuda", "--spec", "tiny", "--examples", "20", "--quiet",
                              "--corpus", str(tmp_path / "c"), "--json", str(run_json)], capsys)
    assert code == 0, out + err
    assert json.loads(run_json.read_text())["warm"] is True


def test_mutants_matrix_runs_the_warmup_on_its_workers_first(cache):
    from mla_fuzz.harness.worker_env import worker_envs
    from mla_fuzz.harness.matrix import matrix_json, run_matrix

    narrow = narrowing.parse({"kv_dtypes": "bf16", "heads": "1", "next_n": "1", "page_sizes": "16",
                                  "no_sparse": True, "no_layer": True})
    plan = prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow)
    got, notes = [], []
    rows = run_matrix(["triton"], {}, graph="emulated", spec="tiny", examples=1, seed=0,
                      worker_envs=worker_envs(1, "emulated"), case_timeout=300.0, warmup=plan, on_warmup=got.append,
                      on_note=notes.append)
    assert len(rows) == 1 and not rows[0]["caught"] and rows[0]["row_started_s"] >= got[0].seconds
    doc = matrix_json(rows, graph="emulated", spec="tiny", examples=1, seed=0, seconds=1.0, warmup=got[0])
    assert doc["warm"] is False and doc["warmup_scenarios"] == 2 and doc["warmup_s"] > 0
    assert any("warmup: 2 scenario(s) in" in n for n in notes)
    assert prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow).warm  # the marker was written


def test_matrix_rows_start_during_the_warmups_last_scenarios(cache):
    """Once every warmup scenario has a worker, an idle worker takes a row: with a long and a
    short scenario on two workers, the second worker is free while the long one still runs and
    the first row starts then, well before the warmup ends; the warmup still runs both."""
    import dataclasses
    import time as _time

    from mla_fuzz.harness.worker_env import worker_envs
    from mla_fuzz.harness.matrix import run_matrix

    narrow = narrowing.parse({"kv_dtypes": "bf16", "heads": "1", "next_n": "1", "page_sizes": "16",
                                  "no_sparse": True, "no_layer": True})
    plan = prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow)
    short, long_ = sorted(plan.specs[0].scenarios, key=lambda sc: "long" in sc.name)
    replay = next(st for st in long_.steps if st["op"] == "replay")
    long_ = dataclasses.replace(long_, steps=long_.steps + [replay] * 30)  # seconds under the interpreter
    plan.specs[0].scenarios = [long_, short]
    got = []
    t0, m0 = _time.time(), _time.monotonic()
    rows = run_matrix(["triton", "triton"], {}, graph="emulated", spec="tiny", examples=1, seed=0,
                      worker_envs=worker_envs(2, "emulated"), case_timeout=300.0, warmup=plan, started_at=t0,
                      on_warmup=lambda out: got.append((out, _time.monotonic() - m0)))
    assert len(rows) == 2 and not any(r["caught"] or r["error"] for r in rows), rows
    out, warmup_end = got[0]
    assert out.ran == 2 and out.completed and out.failed == 0
    # both clocks count from t0: the row started while the long scenario still ran
    assert min(r["row_started_s"] for r in rows) < warmup_end - 1.0, (rows, warmup_end)


def test_campaign_chunks_start_during_the_warmups_last_scenario(cache, tmp_path):
    """``run``'s search starts on the worker the warmup no longer needs: cases are counted
    while the long warmup scenario still runs, before the warmup's summary line."""
    import dataclasses
    import time as _time

    from mla_fuzz.harness.campaign import CampaignOptions, CampaignRun
    from mla_fuzz.harness.worker_env import worker_envs
    from cli_helpers import RecordingDisplay

    narrow = narrowing.parse({"kv_dtypes": "bf16", "heads": "1", "next_n": "1", "page_sizes": "16",
                                  "no_sparse": True, "no_layer": True})
    plan = prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow)
    short, long_ = sorted(plan.specs[0].scenarios, key=lambda sc: "long" in sc.name)
    replay = next(st for st in long_.steps if st["op"] == "replay")
    plan.specs[0].scenarios = [dataclasses.replace(long_, steps=long_.steps + [replay] * 30), short]
    display = RecordingDisplay()
    opts = CampaignOptions(graph="emulated", budget_s=None, examples=6, chunk=3, seed=3, corpus=tmp_path / "c",
                           worker_envs=worker_envs(2, "emulated"), narrow=narrow, warmup=plan)
    res = CampaignRun(opts, display).run()
    assert res.error_kind is None and not res.findings and res.examples >= 6, (res.errors, res.findings)
    assert res.warmup.ran == 2 and res.warmup.completed
    end = next(t for t, text, _ in display.notes if "warmup: 2 scenario(s) in" in text)
    during = [c for c, t in zip(display.counts, display.stamps) if t < end - 0.5]
    assert any(cases > 0 for cases, _ in during), (display.counts, [n[1] for n in display.notes])


def test_a_budget_leaves_the_search_at_least_half(cache, tmp_path):
    """A warmup longer than the whole budget (a cold GPU, a short ``--budget``) starts no
    scenario after half the budget: the search gets the rest and runs examples (on a GPU a
    60 s eager campaign spent 52 s of its budget on the warmup and searched nothing)."""
    import dataclasses

    from mla_fuzz.harness.campaign import WARMUP_SHARE
    from mla_fuzz.harness.worker_env import worker_envs

    narrow = narrowing.parse({"kv_dtypes": "bf16", "heads": "1", "next_n": "1", "page_sizes": "16",
                              "no_sparse": True, "no_layer": True})
    plan = prepare("triton", ["tiny"], "emulated", gpu=False, narrow=narrow)
    long_ = next(sc for sc in plan.specs[0].scenarios if "long" in sc.name)
    replay = next(st for st in long_.steps if st["op"] == "replay")
    slow = dataclasses.replace(long_, steps=long_.steps + [replay] * 6)
    plan.specs[0].scenarios = [slow] * 40
    budget = 16.0
    opts = CampaignOptions(graph="emulated", budget_s=budget, examples=None, chunk=2, seed=3, corpus=tmp_path / "c",
                           worker_envs=worker_envs(1, "emulated"), narrow=narrow, warmup=plan)
    res = CampaignRun(opts, None).run()
    assert res.error_kind is None and not res.findings, (res.errors, res.findings)
    assert not res.warmup.completed and 0 < res.warmup.ran < 40
    assert res.warmup.seconds < budget * WARMUP_SHARE + 8  # the last scenario started before half finishes
    assert res.examples > 0, (res.examples, res.warmup.ran, res.warmup.seconds)
    assert any("half the budget" in w for w in res.warnings), res.warnings
