"""``--mps``: the private MPS daemon's life cycle, the workers' environment, and the
confirmation of crash repros found under MPS (a neighbour's fault must not become a repro).

No GPU is needed: a fake ``nvidia-cuda-mps-control`` (a small script named by
``MLA_FUZZ_MPS_CONTROL``) logs what it is asked, and the backends of ``cli_fakes`` run on
CPU in eager mode, where the MPS variables are inert.
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from mla_fuzz.harness import cli
from mla_fuzz.harness.campaign import CampaignOptions, CampaignRun
from mla_fuzz.harness.mps import MpsDaemon, MpsDaemons, MpsError
from mla_fuzz.harness.worker_env import worker_envs


FAKE_CONTROL = """#!{python}
import json, os, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
log = {log!r}
if sys.argv[1:] == ["-d"]:
    open(os.path.join(pipe, "control"), "w").close()
    event = {{"cmd": "start", "pipe": pipe, "log": os.environ["CUDA_MPS_LOG_DIRECTORY"],
             "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}}
else:
    cmd = sys.stdin.read().strip()
    if cmd == "get_server_list":
        sys.exit(0)  # no server started: no client connected
    event = {{"cmd": cmd, "pipe": pipe}}
with open(log, "a") as fh:
    fh.write(json.dumps(event) + "\\n")
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    log = tmp_path / "control.log"
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(FAKE_CONTROL.format(python=sys.executable, log=str(log)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("MLA_FUZZ_MPS_CONTROL", str(script))
    return log


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_daemon_starts_in_private_dirs_and_quits(fake_control):
    d = MpsDaemon()
    assert d.env() == {}
    with d:
        env = d.env()
        assert os.path.isdir(env["CUDA_MPS_PIPE_DIRECTORY"]) and os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
        root = os.path.dirname(env["CUDA_MPS_PIPE_DIRECTORY"])
    start, quit_ = _events(fake_control)
    assert start == {"cmd": "start", "pipe": env["CUDA_MPS_PIPE_DIRECTORY"], "log": env["CUDA_MPS_LOG_DIRECTORY"],
                     "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
    assert quit_ == {"cmd": "quit", "pipe": env["CUDA_MPS_PIPE_DIRECTORY"]}
    assert not os.path.exists(root) and d.env() == {}


def test_one_daemon_per_gpu_each_pinned_and_clients_renumbered(fake_control):
    """Workers on GPUs 0, 1, 0 get two daemons, each started with only its GPU visible; a
    worker connects to its GPU's daemon and sees that GPU as device 0 (MPS renumbers)."""
    envs = [{"CUDA_VISIBLE_DEVICES": g, "X": str(i)} for i, g in enumerate(["0", "1", "0"])]
    with MpsDaemons.for_envs(envs) as group:
        clients = [group.client_env(e) for e in envs]
        with pytest.raises(KeyError, match="no MPS daemon"):
            group.client_env({"CUDA_VISIBLE_DEVICES": "2"})
    starts = [e for e in _events(fake_control) if e["cmd"] == "start"]
    quits = [e for e in _events(fake_control) if e["cmd"] == "quit"]
    assert [s["cvd"] for s in starts] == ["0", "1"]
    pipe_of = {s["cvd"]: s["pipe"] for s in starts}
    assert [c["CUDA_MPS_PIPE_DIRECTORY"] for c in clients] == [pipe_of["0"], pipe_of["1"], pipe_of["0"]]
    assert all(c["CUDA_VISIBLE_DEVICES"] == "0" for c in clients)
    assert [c["X"] for c in clients] == ["0", "1", "2"]
    assert sorted(q["pipe"] for q in quits) == sorted(pipe_of.values())


def test_daemon_group_stops_started_daemons_when_one_fails(tmp_path, monkeypatch, fake_control):
    """If the second GPU's daemon cannot start, the first is quit again and the error is clear."""
    ctl = tmp_path / "ctl"
    ctl.write_text(f"#!/bin/sh\nif [ \"$CUDA_VISIBLE_DEVICES\" = 1 ] && [ \"$1\" = -d ]; then echo 'GPU 1 busy' >&2; "
                   f"exit 1; fi\nexec {os.environ['MLA_FUZZ_MPS_CONTROL']} \"$@\"\n")
    ctl.chmod(0o755)
    monkeypatch.setenv("MLA_FUZZ_MPS_CONTROL", str(ctl))
    with pytest.raises(MpsError, match="GPU 1 busy"):
        MpsDaemons(["0", "1"]).start()
    events = _events(fake_control)
    assert [e["cmd"] for e in events] == ["start", "quit"] and events[0]["cvd"] == "0"


def test_missing_control_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_FUZZ_MPS_CONTROL", str(tmp_path / "absent"))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control was not found"):
        MpsDaemon()


def test_failing_daemon_start_is_a_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "ctl"
    bad.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("MLA_FUZZ_MPS_CONTROL", str(bad))
    with pytest.raises(MpsError, match="already running"):
        MpsDaemon().start()


def test_run_mps_needs_cuda_mode(capsys):
    code = cli.main(["run", "--graph", "emulated", "--mps", "--examples", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--mps" in err and "cuda" in err and "Traceback" not in err


def _campaign(tmp_path, backend, examples, **kw):
    opts = CampaignOptions(backend=backend, graph="eager", spec="tiny", budget_s=None, examples=examples, seed=0,
                           corpus=tmp_path / "corpus", worker_envs=worker_envs(1, "eager", device_count=0),
                           case_timeout=120.0, chunk=examples, mps=True, **kw)
    return CampaignRun(opts).run(handle_sigint=False)


def test_workers_get_the_daemon_env_and_it_is_stopped(tmp_path, fakes, fake_control, monkeypatch):
    envlog = tmp_path / "env.log"
    monkeypatch.setenv("MLA_FUZZ_TEST_ENVLOG", str(envlog))
    res = _campaign(tmp_path, "cli_fakes:EnvProbeBackend", 2)
    assert not res.findings and res.examples >= 2
    start, quit_ = _events(fake_control)
    seen = set(envlog.read_text().split())
    assert seen == {start["pipe"]}, "every backend instance ran in a worker connected to the daemon"
    assert quit_["cmd"] == "quit"


def test_crash_that_does_not_replay_alone_is_moved_aside(tmp_path, fakes, fake_control, monkeypatch):
    """A worker death under MPS whose scenario passes when replayed alone (without MPS) is
    not reported as a finding; its repro is kept under unconfirmed/ and a warning says why."""
    monkeypatch.setenv("MLA_FUZZ_TEST_MARKER", str(tmp_path / "marker"))
    res = _campaign(tmp_path, "cli_fakes:AbortOnceBackend", 6)
    assert (tmp_path / "marker").exists(), "the backend must have aborted once"
    assert not res.findings and not res.failures
    moved = list((tmp_path / "corpus" / "unconfirmed").glob("*.json"))
    assert len(moved) == 1 and not list((tmp_path / "corpus").glob("*.json"))
    assert any("passes when replayed alone without MPS" in w and str(moved[0]) in w for w in res.warnings)


def test_crash_that_replays_alone_is_kept(tmp_path, fakes, fake_control):
    res = _campaign(tmp_path, "cli_fakes:AbortBackend", 2)
    (finding,) = res.findings.values()
    assert finding.cls == "crash" and finding.path.exists()
    assert not (tmp_path / "corpus" / "unconfirmed").exists()


def _matrix(refs, examples=6):
    from mla_fuzz.harness.matrix import run_matrix
    return run_matrix(refs, {}, graph="eager", spec="tiny", examples=examples, seed=0,
                      worker_envs=worker_envs(2, "eager", device_count=0), case_timeout=120.0, mps=True)


def test_matrix_rows_run_under_the_daemon_and_it_is_stopped(tmp_path, fakes, fake_control, monkeypatch):
    envlog = tmp_path / "env.log"
    monkeypatch.setenv("MLA_FUZZ_TEST_ENVLOG", str(envlog))
    (row,) = _matrix(["cli_fakes:EnvProbeBackend"], examples=2)
    assert not row["caught"] and not row.get("mps_rerun") and row["process_end"] is None
    start, quit_ = _events(fake_control)
    assert set(envlog.read_text().split()) == {start["pipe"]} and quit_["cmd"] == "quit"


def test_matrix_row_whose_worker_died_under_mps_runs_again_without(tmp_path, fakes, fake_control, monkeypatch):
    """Under MPS a worker's death may be its neighbour's GPU fault: the row runs again in a
    worker without MPS, and that run is the row. A backend that aborts once passes there; one
    that always aborts is still caught as a crash."""
    marker, envlog = tmp_path / "marker", tmp_path / "env.log"
    monkeypatch.setenv("MLA_FUZZ_TEST_MARKER", str(marker))
    once, always = _matrix(["cli_fakes:AbortOnceBackend", "cli_fakes:AbortBackend"])
    assert marker.exists(), "the backend must have aborted once"
    assert once["mps_rerun"] and not once["caught"] and once["process_end"] is None, once
    assert always["mps_rerun"] and always["caught"] and always["diagnosis"] == "crash", always
    assert always["process_end"] == "died"


def test_mutants_mps_needs_cuda_mode(capsys):
    code = cli.main(["mutants", "--graph", "emulated", "--mps", "--only", "nan-zero-len"])
    err = capsys.readouterr().err
    assert code == 2 and "--mps" in err and "cuda" in err and "Traceback" not in err
