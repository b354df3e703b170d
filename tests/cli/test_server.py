"""``mla-fuzz server``: a command started while a server runs for its environment runs in a
process forked from it, with the user's descriptors, arguments, folder and clock, and gives
the same result as without it; Ctrl-C reaches it; a server whose code changed, or one of
another environment, is not used; an idle server exits; bad input is one line, exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla_fuzz.harness import server, zygote
from mla_fuzz.harness.procs import pid_alive

pytestmark = pytest.mark.skipif(not zygote.enabled() or sys.platform != "linux",
                                reason="the server needs Linux and the zygote")


def _env(tmp: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update({"MLA_FUZZ_SERVER": "1", "MLA_FUZZ_SERVER_DIR": str(tmp / "servers"), "TRITON_INTERPRET": "1"})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def _cli(args: list[str], env: dict, cwd: Path, timeout: float = 240.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(environment, folder, record) of one server for the module's commands (graph emulated)."""
    tmp = tmp_path_factory.mktemp("server")
    env = _env(tmp)
    r = _cli(["server", "start", "--graph", "emulated"], env, tmp)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "ready, pid" in r.stdout, r.stdout
    recs = [json.loads(p.read_text()) for p in (tmp / "servers").glob("*.json")]
    assert len(recs) == 1 and pid_alive(recs[0]["pid"])
    yield env, tmp, recs[0]
    r = _cli(["server", "stop"], env, tmp)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert not pid_alive(recs[0]["pid"])
    assert not list((tmp / "servers").glob("*.sock"))


def test_a_command_runs_in_the_server_with_the_users_folder_and_gives_the_same_result(served, tmp_path):
    env, _, rec = served
    again = _cli(["server", "start", "--graph", "emulated"], env, tmp_path)
    assert again.returncode == 0 and f"already running for this environment, pid {rec['pid']}" in again.stdout
    args = ["mutants", "--only", "item-in-capture", "--graph", "emulated", "--examples", "3", "--json", "m.json"]
    inside = _cli(args, env, tmp_path)  # a relative --json: written in the user's folder
    assert inside.returncode == 0, inside.stderr
    assert f"forked from the mla-fuzz server (pid {rec['pid']}" in inside.stderr, inside.stderr
    alone = _cli([*args[:-1], "alone.json"], {**env, "MLA_FUZZ_SERVER": "0"}, tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert "forked from the mla-fuzz server" not in alone.stderr
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("m.json", "alone.json"))
    keys = ("backend", "caught", "examples_to_detect", "diagnosis", "matches")
    assert [{k: r[k] for k in keys} for r in got["rows"]] == [{k: r[k] for k in keys} for r in want["rows"]]
    assert got["rows"][0]["caught"] and got["rows"][0]["diagnosis"] == "host-sync"


def test_the_commands_clock_starts_when_the_client_did(served, tmp_path, monkeypatch):
    env, _, _ = served
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    from mla_fuzz.harness import cli
    argv = ["mutants", "--only", "item-in-capture", "--graph", "emulated", "--examples", "2", "--json", "t.json"]
    started = time.time() - 40.0  # as if the client had started 40 s ago
    code = server.run_command(argv, cli._expected_worker_env("emulated"), started)
    assert code == 0, f"server at {served[2]['package']} (None: it does not serve this process, {server._PKG})"
    row = json.loads((tmp_path / "t.json").read_text())["rows"][0]
    assert row["caught"] and row["seconds_to_detect"] >= 40.0, row


def test_ctrl_c_reaches_the_command_and_its_status_comes_back(served, tmp_path):
    env, _, rec = served
    proc = subprocess.Popen([sys.executable, "-m", "mla_fuzz.harness.cli", "run", "--graph", "emulated",
                             "--budget", "120s", "--corpus", str(tmp_path / "c"), "--json", "rep.json"], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    command = None
    while command is None:  # the command is the server's child, not the client's
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        kids = [p for p in _children(rec["pid"]) if Path(f"/proc/{p}/comm").read_text().strip() == "mla-fuzz"]
        command = kids[0] if kids else None
        time.sleep(0.1)
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "INTERRUPTED" in out and "Traceback" not in err, out + err
    assert json.loads((tmp_path / "rep.json").read_text())["interrupted"] is True
    assert not pid_alive(command)


def test_a_client_that_dies_interrupts_its_command(served, tmp_path):
    env, _, rec = served
    proc = subprocess.Popen([sys.executable, "-m", "mla_fuzz.harness.cli", "run", "--graph", "emulated",
                             "--budget", "120s", "--corpus", str(tmp_path / "c")], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    command = None
    while command is None:
        assert time.monotonic() < deadline and proc.poll() is None
        kids = [p for p in _children(rec["pid"]) if Path(f"/proc/{p}/comm").read_text().strip() == "mla-fuzz"]
        command = kids[0] if kids else None
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while pid_alive(command):
        assert time.monotonic() < deadline, "the command outlived its client by a minute"
        time.sleep(0.2)


def test_a_client_stays_attached_to_its_command_when_the_server_dies(tmp_path):
    env = _env(tmp_path)
    assert _cli(["server", "start", "--graph", "emulated"], env, tmp_path).returncode == 0
    rec = json.loads(next((tmp_path / "servers").glob("*.json")).read_text())
    proc = subprocess.Popen([sys.executable, "-m", "mla_fuzz.harness.cli", "run", "--graph", "emulated",
                             "--budget", "8s", "--corpus", str(tmp_path / "c"), "--json", "rep.json"], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    command = None
    while command is None:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        kids = [p for p in _children(rec["pid"]) if Path(f"/proc/{p}/comm").read_text().strip() == "mla-fuzz"]
        command = kids[0] if kids else None
        time.sleep(0.1)
    os.kill(rec["pid"], signal.SIGKILL)  # the OOM killer's choice, say
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "the mla-fuzz server ended while it ran this command" in err, err
    assert not pid_alive(command), "the client returned before its command ended"
    assert json.loads((tmp_path / "rep.json").read_text())["elapsed_s"] >= 8.0  # the campaign ran its budget


def test_another_environment_or_server_off_starts_its_own_imports(served, tmp_path):
    env, _, _ = served
    args = ["mutants", "--only", "item-in-capture", "--graph", "emulated", "--examples", "1", "--json", "o.json"]
    for other in ({**env, "TRITON_MLA_FUZZ_TEST": "another import environment"}, {**env, "MLA_FUZZ_SERVER": "0"}):
        r = _cli(args, other, tmp_path)
        assert r.returncode == 0, r.stderr
        assert "forked from one process (started as the command started)" in r.stderr, r.stderr


def test_a_server_whose_code_changed_refuses_and_stops_and_the_command_runs_without_it(tmp_path):
    env = _env(tmp_path)
    r = _cli(["server", "start", "--graph", "emulated"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    rec = json.loads(next((tmp_path / "servers").glob("*.json")).read_text())
    procs_py = Path(rec["package"]) / "harness" / "procs.py"  # a module the server imported
    st = os.stat(procs_py)
    os.utime(procs_py, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        m = _cli(["mutants", "--only", "item-in-capture", "--graph", "emulated", "--examples", "1", "--json",
                  "s.json"], env, tmp_path)
    finally:
        os.utime(procs_py, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert m.returncode == 0, m.stderr
    assert "note: not using the mla-fuzz server:" in m.stderr and "procs.py changed" in m.stderr, m.stderr
    assert "forked from one process (started as the command started)" in m.stderr
    deadline = time.monotonic() + 30
    while pid_alive(rec["pid"]):
        assert time.monotonic() < deadline, "a stale server kept running"
        time.sleep(0.1)
    assert "no mla-fuzz server runs" in _cli(["server", "status"], env, tmp_path).stdout


def test_an_idle_server_exits(tmp_path):
    env = _env(tmp_path)
    r = _cli(["server", "start", "--graph", "emulated", "--idle-minutes", "0.02"], env, tmp_path)
    assert r.returncode == 0 and "exits after 0.02 min" in r.stdout, r.stdout + r.stderr
    rec = json.loads(next((tmp_path / "servers").glob("*.json")).read_text())
    deadline = time.monotonic() + 30
    while pid_alive(rec["pid"]):
        assert time.monotonic() < deadline, "an idle server did not exit"
        time.sleep(0.1)
    assert not list((tmp_path / "servers").glob("*.sock"))


@pytest.mark.parametrize("args, says", [
    (["server", "stop", "--idle-minutes", "3"], "--idle-minutes goes with start"),
    (["server", "start", "--idle-minutes", "-1"], "--idle-minutes must be a positive number"),
    (["server", "status", "--all"], "--all goes with stop"),
    (["server", "restart"], "invalid choice"),
])
def test_bad_server_arguments_are_one_line_and_exit_2(tmp_path, args, says):
    r = _cli(args, _env(tmp_path), tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and lines[-1].startswith("mla-fuzz"), r.stderr
    assert not (tmp_path / "servers").exists() or not list((tmp_path / "servers").glob("*.sock"))


def test_a_server_folder_deeper_than_a_socket_address_allows_still_serves(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # the socket's path alone exceeds the 107-byte address limit
    env = _env(tmp_path, MLA_FUZZ_SERVER_DIR=str(deep))
    assert len(str(deep / "0123456789abcdef.sock")) > 107
    r = _cli(["server", "start", "--graph", "emulated"], env, tmp_path)
    assert r.returncode == 0 and "ready, pid" in r.stdout, r.stdout + r.stderr
    try:
        m = _cli(["mutants", "--only", "item-in-capture", "--graph", "emulated", "--examples", "1"], env, tmp_path)
        assert m.returncode == 0 and "forked from the mla-fuzz server" in m.stderr, m.stderr
    finally:
        assert "stopped" in _cli(["server", "stop"], env, tmp_path).stdout
