"""A campaign interrupted from outside: ``kill -9`` leaves only complete repro files and no
orphaned workers; Ctrl-C (SIGINT) writes the report so far and keeps every repro found."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mla_fuzz.harness.procs import pid_alive
from mla_fuzz.harness.repro import load_repro

TESTS = str(Path(__file__).resolve().parent.parent)
ROOT = str(Path(__file__).resolve().parents[2])


def _env() -> dict:
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([TESTS] + parts)
    env.setdefault("TRITON_INTERPRET", "1")
    return env


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mla_fuzz.harness.cli", "run", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for_repro(corpus: Path, proc: subprocess.Popen, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if corpus.is_dir() and any(p.suffix == ".json" and not p.name.startswith(".") for p in corpus.iterdir()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no repro within {timeout}s: {proc.communicate()}")


def _descendants(pid: int) -> list[int]:
    """Children, their children, ...: the workers may be the children of the command's zygote."""
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (int(x) for x in (task / "children").read_text().split()):
                out += [child] + _descendants(child)
    except OSError:  # it ended while we looked
        pass
    return out


def test_kill9_leaves_complete_repros_and_no_orphans(tmp_path):
    corpus = tmp_path / "corpus"
    # AbortBackend crashes workers over and over, so repros are being written and reduced
    # (new file written, old one removed) while the campaign is killed.
    proc = _start(["--backend", "cli_fakes:AbortBackend", "--graph", "eager", "--budget", "300", "--chunk", "1",
                   "--workers", "2", "--seed", "11", "--corpus", str(corpus), "--quiet"])
    try:
        _wait_for_repro(corpus, proc)
        time.sleep(1.0)
        workers = _descendants(proc.pid)
        assert workers, "the campaign runs its cases in worker processes"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    files = [p for p in corpus.iterdir() if p.suffix == ".json" and not p.name.startswith(".")]
    assert files
    for p in files:
        data = load_repro(p)  # raises on a truncated or malformed file
        assert data["diagnosis"]["cls"] == "crash"
    deadline = time.monotonic() + 60
    while any(pid_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(w) for w in workers), "workers outlived their killed parent"


def test_sigint_writes_report_and_keeps_repros(tmp_path):
    corpus, report = tmp_path / "corpus", tmp_path / "report.json"
    proc = _start(["--backend", "cli_fakes:RefBackend", "--graph", "emulated", "--budget", "300", "--chunk", "2",
                   "--seed", "5", "--corpus", str(corpus), "--json", str(report), "--quiet"])
    try:
        _wait_for_repro(corpus, proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert b"Traceback" not in err
    rep = json.loads(report.read_text())
    assert rep["interrupted"] is True and rep["exit_code"] == 1
    assert rep["elapsed_s"] < 300
    assert len(rep["failures"]) == 1
    data = load_repro(rep["failures"][0]["path"])
    assert data["diagnosis"]["cls"] == "host-sync"
    assert b"INTERRUPTED" in out
