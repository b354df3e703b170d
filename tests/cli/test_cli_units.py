"""Fast checks of the mla-fuzz command's pieces: argument errors, repro-file errors, budget
parsing, worker environments, chunk seeds, crash repros and their reduction. No worker
processes are started here."""
from __future__ import annotations

import json

import pytest

from mla_fuzz.harness import cli
from mla_fuzz.harness.campaign import chunk_seed
from mla_fuzz.harness.crash_repro import StepReducer, crash_repro, is_process_failure, valid_steps
from mla_fuzz.harness.matrix import verdict
from mla_fuzz.harness.render import scenario_lines, step_line
from mla_fuzz.harness.repro import load_repro, signature, write_repro
from mla_fuzz.harness.worker_env import worker_envs
from mla_fuzz.mla_ref import ModelSpec


def _run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("text, seconds", [("90", 90), ("60s", 60), ("5m", 300), ("1h30m", 5400), ("1.5m", 90),
                                           ("500ms", 0.5), (" 2M ", 120)])
def test_parse_duration(text, seconds):
    assert cli.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "m", "-5", "0", "5m-1s", "1e3"])
def test_parse_duration_rejects(text):
    with pytest.raises(cli.UsageError, match="--budget"):
        cli.parse_duration(text)


@pytest.mark.parametrize("argv, needle", [
    (["run", "--budget", "abc"], "--budget"),
    (["run", "--examples", "0"], "--examples"),
    (["run", "--workers", "many"], "--workers"),
    (["run", "--graph", "tpu"], "invalid choice"),
    (["run", "--spec", "huge"], "invalid choice"),
    (["run", "--backend", "triton", "--mutant", "x"], "either --backend or --mutant"),
    (["run", "--backend", "no_such_module_xyz:Backend", "--examples", "1"], "no_such_module_xyz"),
    (["run", "--backend", "nocolon", "--examples", "1"], "nocolon"),
    (["run", "--seed", "x1"], "--seed"),
    (["run", "--case-timeout", "soon"], "--case-timeout"),
    (["run", "--bogus"], "unrecognized"),
    (["replay"], "FILE"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2_with_one_line(argv, needle, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2
    line = _one_line_error(err)
    assert "error" in line and needle in line


def test_graph_cuda_without_gpu_is_usage_error(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, _, err = _run(["run", "--graph", "cuda", "--examples", "1"], capsys)
    assert code == 2
    assert "cuda" in _one_line_error(err).lower()


def _valid_repro() -> dict:
    cfg = {"spec": ModelSpec.tiny(num_heads=3).to_dict(), "kv_dtype": "bf16", "q_dtype": "bf16", "page_size": 16,
           "next_n": 2, "capture_sizes": [2, 4], "max_pages_per_seq": 4, "layer": False, "fp8_out": False, "seed": 5}
    steps = [{"op": "eager", "batch": {"seed": 1, "seq_lens": [3, 0], "q_lens": [1, 0], "max_decode_len": 1},
              "pad_to": 4, "poison": True},
             {"op": "capture", "size": 4, "batch": {"seed": 2, "seq_lens": [17], "q_lens": [2], "max_decode_len": 2}},
             {"op": "replay", "size": 4, "batch": {"seed": 3, "seq_lens": [16, 1], "q_lens": [1, 1],
                                                   "max_decode_len": 1}, "poison": False}]
    info = {"inflight": {"t": "step", "cfg": cfg, "steps": steps}, "returncode": -6, "signal": "SIGABRT",
            "log_tail": ["Fatal Python error: Aborted", "", "Current thread 0x1 (most recent call first):",
                         '  File "/x/backend.py", line 7 in forward', '  File "/x/executor.py", line 9 in apply']}
    return crash_repro("died", "pkg.mod:Backend", "emulated", info, {"seed": 1})


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ('{"format": "mla-fuzz-repro/1", "backend": "tri', "not valid JSON"),     # truncated write
    ('[1, 2, 3]', "not an mla-fuzz repro"),
    ('{"format": "something-else/9"}', "not an mla-fuzz repro"),
    ("\x00\xff\xfe", "not valid JSON"),
])
def test_replay_bad_files_exit_2(tmp_path, content, needle, capsys):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_bytes(content.encode("latin-1"))
    code, out, err = _run(["replay", str(path)], capsys)
    assert code == 2
    line = _one_line_error(err)
    assert needle in line and str(path) in line


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.pop("steps"), "missing field 'steps'"),
    (lambda d: d.update(steps=[]), "non-empty"),
    (lambda d: d["steps"][2].update(size=3), "capture size"),
    (lambda d: d["config"].update(kv_dtype="int4"), "kv_dtype"),
    (lambda d: d["config"].update(colour="blue"), "unknown fields"),
])
def test_replay_malformed_repro_exit_2(tmp_path, mutate, needle, capsys):
    data = _valid_repro()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    code, _, err = _run(["replay", str(path)], capsys)
    assert code == 2
    assert needle in _one_line_error(err)


def test_crash_repro_is_a_valid_repro(tmp_path):
    data = _valid_repro()
    path = write_repro(data, tmp_path)
    back = load_repro(path)
    assert back["steps"] == data["steps"]
    assert back["failure"]["oracle"] == "worker-died" and back["failure"]["step"] == 2
    assert back["diagnosis"]["cls"] == "crash"
    assert is_process_failure(back)
    # the message points at the innermost frame of faulthandler's dump
    assert "SIGABRT" in back["failure"]["message"] and "backend.py" in back["failure"]["message"]
    # the key names the signal: an abort and a lost CUDA context are two findings, not one
    assert signature(back) == "pkg.mod:Backend|crash|worker-died:SIGABRT"


def test_crash_repro_needs_a_step():
    assert crash_repro("died", "b", "eager", {"inflight": None}, {}) is None
    assert crash_repro("hung", "b", "eager", {"inflight": {"t": "step", "cfg": {}, "steps": []}}, {}, 5) is None


def test_crash_during_diagnosis_keeps_the_failure():
    data = _valid_repro()
    info = {"inflight": {"t": "phase", "cfg": data["config"], "steps": data["steps"],
                         "failure": {"oracle": "replay-eager", "step": 2, "message": "rows differ"}},
            "returncode": -9, "signal": "SIGKILL", "log_tail": []}
    r = crash_repro("hung", "b", "emulated", info, {}, 10.0)
    assert r["failure"]["oracle"] == "replay-eager" and r["diagnosis"]["cls"] == "hang"
    assert "rows differ" in r["diagnosis"]["explanation"]


def _reduce(steps, crashes) -> tuple[list, int]:
    red = StepReducer(steps)
    runs = 0
    while (cand := red.candidate()) is not None:
        assert valid_steps(cand) and cand[-1] is steps[-1]
        runs += 1
        red.result(crashes(cand))
    return red.best, runs


def _steps(*ops):
    out = []
    for i, op in enumerate(ops):
        s = {"op": op, "batch": {"seed": i, "seq_lens": [1], "q_lens": [1]}}
        if op in ("capture", "replay", "warmup"):
            s["size"] = 2
        out.append(s)
    return out


def test_reducer_last_step_alone():
    steps = _steps("eager", "warmup", "eager", "eager")
    best, runs = _reduce(steps, lambda c: c[-1] is steps[-1])
    assert best == [steps[-1]] and runs == 1


def test_reducer_keeps_what_the_crash_needs():
    steps = _steps("eager", "warmup", "eager", "capture", "eager", "replay")
    need = (steps[1], steps[3])  # crash needs the warmup before the capture

    def crashes(c):
        return all(any(x is n for x in c) for n in need)

    best, _ = _reduce(steps, crashes)
    assert best == [steps[1], steps[3], steps[5]]


def test_reducer_never_orphans_a_replay():
    steps = _steps("capture", "eager", "replay")
    best, _ = _reduce(steps, lambda c: True)
    assert [s["op"] for s in best] == ["capture", "replay"]


def test_chunk_seeds_distinct_and_stable():
    seeds = [chunk_seed(7, k) for k in range(2000)]
    assert len(set(seeds)) == len(seeds)
    assert seeds[:5] == [chunk_seed(7, k) for k in range(5)]
    assert chunk_seed(8, 0) != chunk_seed(7, 0)


def test_worker_envs_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs = worker_envs("auto", "cuda", device_count=4, cpu_count=64)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3"]
    envs = worker_envs(6, "cuda", device_count=4, cpu_count=64)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3", "0", "1"]
    # GPU workers run one intra-op thread each, whatever the core count
    assert all(e["MLA_FUZZ_TORCH_THREADS"] == "1" for e in envs)
    # ... and make their CUDA context while importing when the caller's environment asks
    monkeypatch.delenv("MLA_FUZZ_CUDA_EARLY", raising=False)
    assert all(e["MLA_FUZZ_CUDA_EARLY"] == "0" for e in worker_envs(2, "cuda", device_count=1, cpu_count=64))
    monkeypatch.setenv("MLA_FUZZ_CUDA_EARLY", "1")
    assert all(e["MLA_FUZZ_CUDA_EARLY"] == "1" for e in worker_envs(2, "cuda", device_count=1, cpu_count=64))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert all(e["OMP_NUM_THREADS"] == "1" for e in worker_envs(2, "cuda", device_count=1, cpu_count=64))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert all("OMP_NUM_THREADS" not in e for e in worker_envs(2, "cuda", device_count=1, cpu_count=64))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    envs = worker_envs("auto", "cuda", device_count=2, cpu_count=64)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["5", "7"]
    envs = worker_envs("auto", "eager", device_count=2, cpu_count=64)
    assert len(envs) == 2


def test_worker_envs_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    envs = worker_envs("auto", "emulated", device_count=2, cpu_count=8)
    assert len(envs) == 8
    assert all(e["TRITON_INTERPRET"] and e["CUDA_VISIBLE_DEVICES"] == "" for e in envs)
    assert all(e["OMP_NUM_THREADS"] == "1" for e in envs)
    assert not any("MLA_FUZZ_CUDA_EARLY" in e for e in envs)  # a CPU worker never touches the GPU
    envs = worker_envs(2, "emulated", device_count=0, cpu_count=8)
    assert [e["MLA_FUZZ_TORCH_THREADS"] for e in envs] == ["4", "4"]
    assert len(worker_envs("auto", "eager", device_count=0, cpu_count=3)) == 3


def test_step_lines_are_readable():
    data = _valid_repro()
    line = step_line(0, data["steps"][0])
    for part in ("eager", "B=2", "seq_lens [3, 0]", "q_lens [1, 0]", "pad_to 4", "poison"):
        assert part in line
    lines = scenario_lines(data["config"], data["steps"], failing=2, oracle="replay-eager")
    assert lines[0].startswith("config: spec tiny (3 heads), kv bf16")
    assert len(lines) == 4 and lines[3].startswith(">") and "replay-eager" in lines[3]
    assert "size 4" in lines[2] and not lines[2].startswith(">")


def test_matrix_verdict():
    mut = {"name": "m", "backend": "mutant:m", "caught": True, "examples": 10, "diagnosis": "laziness",
           "expected": ["laziness"], "matches": True}
    clean = {"name": "triton", "backend": "triton", "caught": False, "examples": 10, "diagnosis": None,
             "expected": [], "matches": None}
    assert verdict([mut, clean]) == (0, [])
    code, why = verdict([dict(mut, caught=False), clean])
    assert code == 1 and "escaped" in why[0]
    code, why = verdict([mut, dict(clean, caught=True, diagnosis="numerical")])
    assert code == 1 and "clean backend flagged" in why[0]
    # what the finding said comes with it: a flagged clean backend is judged from the matrix alone
    said = dict(clean, caught=True, diagnosis="backend-error", oracle="backend-error",
                message="backend raised AcceleratorError: CUDA error: out of memory (at x.py:3)")
    code, why = verdict([mut, said])
    assert code == 1 and "CUDA error: out of memory (at x.py:3)" in why[0] and "backend-error: " in why[0]
    wrong = dict(mut, diagnosis="numerical", matches=False)
    assert verdict([wrong, clean])[0] == 0
    assert verdict([wrong, clean], strict=True)[0] == 1
