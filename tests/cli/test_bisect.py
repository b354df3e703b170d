"""``mla-fuzz bisect``: exit-code contract of the per-revision runner, import shadowing,
whole bisects (stand-in replay, then the real harness on a mutant's bug), cleanup.

Every git repository here is a throwaway under ``tmp_path``; the assertions that "the
user's checkout is untouched" compare a full snapshot of it before and after.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mla_fuzz.harness import bisect as bis
from mla_fuzz.harness import bisect_step as step

STEP = str(Path(step.__file__).resolve())

# --------------------------------------------------------------------------- helpers

GIT_ID = ["-c", "user.name=bisect-test", "-c", "user.email=bisect@test", "-c", "commit.gpgsign=false",
          "-c", "init.defaultBranch=main"]


def git(repo, *args) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["LC_ALL"] = "C"
    return subprocess.run(["git", *GIT_ID, *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def make_repo(path: Path, commits: list[tuple[str, dict]]) -> list[str]:
    """A linear history: each (subject, {relpath: content or None to delete}); returns the shas."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    shas = []
    for subject, files in commits:
        for rel, content in files.items():
            f = path / rel
            if content is None:
                f.unlink()
                continue
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(content)
        git(path, "add", "-A")
        git(path, "commit", "-q", "--allow-empty", "-m", subject)
        shas.append(git(path, "rev-parse", "HEAD"))
    return shas


def snapshot(repo: Path) -> dict:
    """Everything of the user's checkout a bisect could disturb."""
    gitdir = Path(git(repo, "rev-parse", "--absolute-git-dir"))
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "branch": git(repo, "symbolic-ref", "-q", "--short", "HEAD"),
        "status": git(repo, "status", "--porcelain", "--untracked-files=all"),
        "refs": git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
        "stash": git(repo, "stash", "list"),
        "worktrees": git(repo, "worktree", "list", "--porcelain"),
        "bisect_files": sorted(p.name for p in gitdir.glob("BISECT_*")),
        "worktree_dirs": sorted(p.name for p in (gitdir / "worktrees").glob("*")),
    }


def alive(pid: int, grace: float = 10.0) -> bool:
    """Whether ``pid`` still runs after ``grace`` s (a zombie awaiting its reaper is dead)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def tiny_repro(backend="userbk.backend:Backend") -> dict:
    """A valid repro (one eager step of the tiny spec) for the stand-in replays."""
    from mla_fuzz.harness.repro import FORMAT
    from mla_fuzz.harness.scenario import ScenarioConfig
    from mla_fuzz.mla_ref import ModelSpec
    cfg = ScenarioConfig(spec=ModelSpec.tiny().to_dict())
    step0 = {"op": "eager", "batch": {"seed": 0, "seq_lens": [3], "q_lens": [1], "max_decode_len": 1},
             "pad_to": None, "poison": False}
    return {"format": FORMAT, "backend": backend, "graph_mode": "emulated", "config": cfg.to_dict(),
            "steps": [step0], "failure": None, "diagnosis": None}


# The stand-in replay: behaviour is read from the file `behaviour` of the revision.
STANDIN = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path

    class Result:
        def __init__(self, failed, message="replay != eager on real rows"):
            self.failed = failed
            self.failure = {"oracle": "replay-eager", "step": 2, "message": message} if failed else None
            self.diagnosis = {"cls": "stale-address", "explanation": "stand-in", "oracle": "replay-eager"} if failed else None

    def replay(data, backend=None, graph_mode=None, diagnose_failure=True):
        b = Path("behaviour").read_text().strip()
        d = Path(os.environ["STANDIN_DIR"])
        if b.startswith("seq:"):            # one letter per attempt: P pass, F fail
            n = int((d / "count").read_text()) if (d / "count").exists() else 0
            (d / "count").write_text(str(n + 1))
            b = {"P": "pass", "F": "fail"}[b[4:][n % len(b[4:])]]
        if b == "pass":
            return Result(False)
        if b == "fail":
            return Result(True)
        if b.startswith("failmsg:"):
            return Result(True, b[8:])
        if b == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if b.startswith("exit:"):
            os._exit(int(b[5:]))
        if b.startswith("raise:"):
            raise RuntimeError(b[6:])
        if b == "cudaerr":                  # a real illegal memory access (GPU only)
            import torch, triton, triton.language as tl

            @triton.jit
            def oob(p):
                tl.store(p + (1 << 40), 1.0)

            x = torch.zeros(1, device="cuda")
            oob[(1,)](x)
            torch.cuda.synchronize()
            return Result(False)
        if b == "sleep":
            (d / "pid").write_text(str(os.getpid()))
            time.sleep(600)
        raise AssertionError("unknown behaviour " + b)
''')


def run_step(tmp_path, behaviour, *, build=None, on_crash="bad", retries=0, timeout=None, build_sh=None):
    """Run the per-revision runner once on a one-commit repo; (exit code, log entry)."""
    files = {"standin.py": STANDIN, "behaviour": behaviour}
    if build_sh is not None:
        files["build.sh"] = build_sh
    repo = tmp_path / "r"
    make_repo(repo, [("only", files)])
    state = tmp_path / "state"
    state.mkdir()
    cfg = {"worktree": str(repo), "state": str(state), "repros": [{"path": "x.json", "data": tiny_repro()}],
           "backend": None, "graph_mode": None, "build": build, "on_crash": on_crash, "retries": retries,
           "timeout": timeout, "paths": ["."], "replay_impl": "standin:replay", "python": sys.executable}
    (state / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, STANDIN_DIR=str(state))
    rc = subprocess.run([sys.executable, STEP, "--config", str(state / "config.json")], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=120).returncode
    entries = [json.loads(x) for x in (state / "steps.jsonl").read_text().splitlines()]
    assert len(entries) == 1
    return rc, entries[0]


# --------------------------------------------------------------------------- pure mapping

@pytest.mark.parametrize("kind,on_crash,verdict", [
    ("pass", "bad", "good"), ("pass", "skip", "good"),
    ("fail", "bad", "bad"), ("fail", "skip", "bad"),
    ("untestable", "bad", "skip"), ("untestable", "skip", "skip"),
    ("crash", "bad", "bad"), ("crash", "skip", "skip"),
])
def test_classify_attempt(kind, on_crash, verdict):
    assert step.classify_attempt({"kind": kind, "detail": "x"}, on_crash)[0] == verdict
    assert step.EXIT_FOR[verdict] in (0, 1, 125)


def test_classify_rejects_unknown():
    with pytest.raises(ValueError, match="on_crash"):
        step.classify_attempt({"kind": "pass"}, "abort")
    with pytest.raises(ValueError, match="kind"):
        step.classify_attempt({"kind": "weird"}, "bad")


def test_majority():
    assert step.majority(["bad"], 1) == "bad"
    assert step.majority(["bad"], 3) is None                 # two attempts could still outvote it
    assert step.majority(["bad", "good", "bad"], 3) == "bad"
    assert step.majority(["good", "good"], 3) == "good"      # decided early: the 3rd cannot overturn
    assert step.majority(["good", "bad"], 2) is None
    assert step.majority(["good", "bad", "skip"], 3) is None
    with pytest.raises(ValueError):
        step.majority([], 0)


def test_cuda_error_text():
    assert step.is_cuda_error("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert step.is_cuda_error("torch.AcceleratorError: device-side assert triggered")
    assert not step.is_cuda_error("replay != eager in 3 rows")
    assert not step.is_cuda_error(None)


# --------------------------------------------------------------------------- runner exit codes

@pytest.mark.parametrize("behaviour,on_crash,code,kind", [
    ("pass", "bad", 0, "pass"),
    ("fail", "bad", 1, "fail"),
    ("segv", "bad", 1, "crash"),
    ("segv", "skip", 125, "crash"),
    ("exit:127", "bad", 1, "crash"),          # 126/127/>=128 from the replay never reach git
    ("exit:200", "skip", 125, "crash"),
    ("raise:CUDA error: an illegal memory access was encountered", "skip", 125, "crash"),
    ("raise:CUDA error: an illegal memory access was encountered", "bad", 1, "crash"),
    ("raise:spec not supported by this backend", "bad", 125, "untestable"),   # replay could not run
    ("failmsg:CUDA error: unspecified launch failure", "skip", 125, "crash"),
    ("failmsg:CUDA error: unspecified launch failure", "bad", 1, "crash"),
])
def test_runner_maps_outcomes(tmp_path, behaviour, on_crash, code, kind):
    rc, entry = run_step(tmp_path, behaviour, on_crash=on_crash)
    assert rc == code
    assert entry["exit"] == code and [a["kind"] for a in entry["attempts"]] == [kind]
    if behaviour == "segv":
        assert "SIGSEGV" in entry["attempts"][0]["detail"]
    if code == 1 and kind == "fail":
        assert entry["diagnosis"]["cls"] == "stale-address"


@pytest.mark.gpu
@pytest.mark.parametrize("on_crash,code", [("skip", 125), ("bad", 1)])
def test_runner_real_cuda_error_is_a_crash(tmp_path, on_crash, code):
    rc, entry = run_step(tmp_path, "cudaerr", on_crash=on_crash)
    a = entry["attempts"][0]
    assert rc == code and a["kind"] == "crash", a
    assert "CUDA error" in a["detail"] or "killed by" in a["detail"]


def test_runner_timeout_is_a_crash(tmp_path):
    rc, entry = run_step(tmp_path, "sleep", on_crash="skip", timeout=2)
    assert rc == 125 and "timed out" in entry["attempts"][0]["detail"]
    assert not alive(int((tmp_path / "state" / "pid").read_text()))


@pytest.mark.parametrize("build_sh", ["echo compiling; exit 3\n", "kill -9 $$\n", "exit 127\n"])
def test_runner_build_failure_skips(tmp_path, build_sh):
    rc, entry = run_step(tmp_path, "fail", build="bash build.sh", build_sh=build_sh)
    assert rc == 125 and entry["build_failed"] and entry["attempts"] == []  # no replay at all
    assert "build failed" in entry["reason"]


@pytest.mark.parametrize("seq,retries,code,attempts", [
    ("FPF", 2, 1, 3),    # 2 of 3 fail -> bad
    ("PFP", 2, 0, 3),
    ("FFP", 2, 1, 2),    # majority reached after 2: the third is not run
    ("PF", 1, 125, 2),   # tie -> skip
    ("PFFPF", 4, 1, 5),
])
def test_runner_flaky_majority(tmp_path, seq, retries, code, attempts):
    rc, entry = run_step(tmp_path, "seq:" + seq, retries=retries)
    assert rc == code and len(entry["attempts"]) == attempts
    assert [a["kind"] for a in entry["attempts"]] == [{"P": "pass", "F": "fail"}[c] for c in seq[:attempts]]
    if code == 125:
        assert "no majority" in entry["reason"]


def test_runner_internal_error_is_skip(tmp_path):
    # A config that cannot be read must not hand git an aborting exit code.
    r = subprocess.run([sys.executable, STEP, "--config", str(tmp_path / "missing.json")], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 125


@pytest.mark.parametrize("cmd,code", [
    ("exit 0", 0), ("exit 1", 1), ("exit 125", 125),
    ("exit 126", 125), ("exit 127", 125), ("exit 2", 125), ("exit 200", 125), ("kill -SEGV $$", 125),
    ("no-such-command-xyz", 125),
])
def test_step_guard_never_aborts_git(cmd, code):
    """What git sees if the runner process itself dies or cannot start."""
    r = subprocess.run(["sh", "-c", bis.STEP_GUARD, "guard", "sh", "-c", cmd], capture_output=True)
    assert r.returncode == code


# --------------------------------------------------------------------------- imports

def test_revision_shadows_editable_install_but_not_the_judge(tmp_path):
    """The worktree's `kernels` wins over our editable install; mla_ref/harness stay the tool's."""
    from mla_fuzz import kernels
    from mla_fuzz import mla_ref
    assert Path(kernels.__file__).resolve().parent != tmp_path / "wt" / "kernels"
    wt = tmp_path / "wt"
    (wt / "kernels").mkdir(parents=True)
    (wt / "kernels" / "__init__.py").write_text("MARK = 'revision'\n")
    (wt / "mla_ref").mkdir()
    (wt / "mla_ref" / "__init__.py").write_text("raise ImportError('the revision must not supply the oracle')\n")
    (wt / "harness").mkdir()
    (wt / "harness" / "__init__.py").write_text("raise ImportError('the revision must not supply the harness')\n")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"worktree": str(wt), "paths": ["."]}))
    env = step.child_env({"worktree": str(wt), "paths": ["."]})
    r = subprocess.run([sys.executable, STEP, "--probe", str(cfg), "mla_fuzz.kernels", "mla_ref"], cwd=wt, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    files = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(files["mla_fuzz.kernels"]).resolve() == (wt / "kernels" / "__init__.py").resolve()
    assert Path(files["mla_fuzz.mla_ref"]).resolve() == Path(mla_ref.__file__).resolve()
    # revisions from before the namespace import the oracle top-level: the same pinned copy
    assert Path(files["mla_ref"]).resolve() == Path(mla_ref.__file__).resolve()
    assert Path(files["mla_fuzz.harness"]).resolve().parent == Path(step.__file__).resolve().parent


# --------------------------------------------------------------------------- whole bisects (stand-in)

def standin_history(guilty=8, broken=5, n=12):
    """c0..c{n-1}: behaviour fails from `guilty` on; build.sh fails at `broken` only."""
    commits = [("c0 initial", {"standin.py": STANDIN, "behaviour": "pass", "build.sh": "exit 0\n",
                               "notes.txt": "0\n"})]
    for i in range(1, n):
        files = {"notes.txt": f"{i}\n"}
        subject = f"c{i} harmless edit"
        if i == guilty:
            files["behaviour"], subject = "fail", f"c{i} reuse the scheduler buffers"
        if i == broken:
            files["build.sh"], subject = "echo 'syntax error' >&2; exit 1\n", f"c{i} break the build"
        if i == broken + 1:
            files["build.sh"], subject = "exit 0\n", f"c{i} fix the build"
        commits.append((subject, files))
    return commits


@pytest.fixture
def standin_env(tmp_path, monkeypatch):
    d = tmp_path / "standin"
    d.mkdir()
    monkeypatch.setenv("STANDIN_DIR", str(d))
    return d


def write_repro(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_bisect_standin_finds_guilty_skips_broken_and_cleans_up(tmp_path, standin_env, capsys):
    repo = tmp_path / "repo"
    shas = make_repo(repo, standin_history())
    (repo / "untracked.txt").write_text("user's own file\n")     # the user's state must survive
    git(repo, "checkout", "-q", "-b", "feature")
    before = snapshot(repo)
    repro = write_repro(tmp_path / "r.json", tiny_repro())
    out_json = tmp_path / "out.json"
    logs = tmp_path / "logs"
    rc = bis.main(["--repo", str(repo), "--good", shas[0], "--bad", shas[-1], "--build", "bash build.sh",
                   "--replay-impl", "standin:replay", "--json", str(out_json), "--keep-logs", str(logs), str(repro)])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out_json.read_text())
    assert res["first_bad"] == shas[8] and res["subject"] == "c8 reuse the scheduler buffers"
    assert res["diagnosis"]["cls"] == "stale-address"
    assert [s["commit"] for s in res["skipped"]] == [shas[5]]
    assert "build failed" in res["skipped"][0]["reason"]
    phases = [s["phase"] for s in res["steps"]]
    assert phases[:2] == ["check", "check"] and set(phases[2:]) == {"bisect"}
    # every verdict agrees with the history
    for s in res["steps"]:
        i = shas.index(s["commit"])
        assert s["verdict"] == ("skip" if i == 5 else "bad" if i >= 8 else "good")
    assert f"first bad commit: {shas[8]}" in out and "stale-address" in out
    assert f"# first bad commit: [{shas[8]}]" in res["bisect_log"]
    assert "syntax error" in (logs / f"{shas[5][:12]}-build.log").read_text()
    assert snapshot(repo) == before


def test_bisect_ambiguous_when_only_skips_remain(tmp_path, standin_env, capsys):
    # The build is broken exactly at the guilty commit's parent: git cannot decide between them.
    repo = tmp_path / "repo"
    shas = make_repo(repo, standin_history(guilty=6, broken=5))
    before = snapshot(repo)
    repro = write_repro(tmp_path / "r.json", tiny_repro())
    rc = bis.main(["--repo", str(repo), "--good", shas[0], "--bad", shas[-1], "--build", "bash build.sh",
                   "--replay-impl", "standin:replay", "--no-check-ends", str(repro)])
    out = capsys.readouterr().out
    assert rc == 1 and "no single answer" in out
    assert shas[5][:12] in out and shas[6][:12] in out
    assert snapshot(repo) == before


def test_bisect_refuses_when_bad_end_passes(tmp_path, standin_env, capsys):
    repo = tmp_path / "repo"
    shas = make_repo(repo, standin_history(guilty=99, broken=99))
    before = snapshot(repo)
    rc = bis.main(["--repo", str(repo), "--good", shas[0], "--bad", shas[-1], "--replay-impl", "standin:replay",
                   str(write_repro(tmp_path / "r.json", tiny_repro()))])
    assert rc == 1 and "passes at --bad" in capsys.readouterr().out
    assert snapshot(repo) == before


@pytest.mark.parametrize("args,needle", [
    (["--good", "nosuchrev"], "--good 'nosuchrev' is not a commit"),
    (["--retries", "-1"], "--retries must be >= 0"),
    (["--backend", "not a ref"], "--backend must be"),
    (["--build", " "], "--build must be"),
    (["--good", "HEAD", "--bad", "HEAD~3"], "is not an ancestor"),
    (["--repo", "/nonexistent-dir"], "is not a directory"),
])
def test_bad_arguments_exit_2(tmp_path, standin_env, capsys, args, needle):
    repo = tmp_path / "repo"
    make_repo(repo, standin_history(n=4, guilty=2, broken=99))
    repro = write_repro(tmp_path / "r.json", tiny_repro())
    base = {"--repo": str(repo), "--good": "HEAD~3", "--bad": "HEAD"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    argv = [x for kv in base.items() for x in kv] + [str(repro)]
    before = snapshot(repo)
    assert bis.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert snapshot(repo) == before


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"format": "something-else"}), "not an mla-fuzz repro"),
    (None, "no such file"),
])
def test_malformed_repro_exit_2(tmp_path, capsys, content, needle):
    repo = tmp_path / "repo"
    make_repo(repo, standin_history(n=3, guilty=2, broken=99))
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert bis.main(["--repo", str(repo), "--good", "HEAD~2", "--bad", "HEAD", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "malformed repro" in err and needle in err
    assert not (Path(git(repo, "rev-parse", "--absolute-git-dir")) / "worktrees").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupt_resets_and_removes_worktree(tmp_path, sig):
    repo = tmp_path / "repo"
    commits = standin_history(guilty=3, broken=99, n=8)
    commits[0][1]["behaviour"] = "sleep"
    commits[3][1]["behaviour"] = "sleep"
    shas = make_repo(repo, commits)
    before = snapshot(repo)
    d = tmp_path / "standin"
    d.mkdir()
    repro = write_repro(tmp_path / "r.json", tiny_repro())
    env = dict(os.environ, STANDIN_DIR=str(d))
    proc = subprocess.Popen([sys.executable, "-m", "mla_fuzz.harness.bisect", "--repo", str(repo), "--good", shas[0],
                             "--bad", shas[-1], "--no-check-ends", "--replay-impl", "standin:replay", str(repro)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(bis.__file__).resolve().parent.parent)
    deadline = time.monotonic() + 60
    while not (d / "pid").exists():           # a replay child is running inside git bisect run
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    # mid-bisect: the bisect state lives in the temporary worktree only
    assert snapshot(repo)["bisect_files"] == [] and len(snapshot(repo)["worktree_dirs"]) == 1
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not alive(int((d / "pid").read_text()))   # the replay child did not outlive the bisect
    assert snapshot(repo) == before


# --------------------------------------------------------------------------- end to end

# The bug of harness.mutants.SharedLazySched (vLLM #42444), pasted into a user's backend.
LAZY_OVERRIDE = '''
    def _plan(self, md):
        # "optimisation": plan lazily, only when nothing planned this state yet
        md.sched.plan(md.seq_lens)
'''


def userbk_source(edit: int, buggy: bool) -> str:
    return textwrap.dedent(f'''
        """A user's decode backend: our Triton backend with their own tweaks."""
        from mla_fuzz.kernels import TritonMLABackend

        TWEAK_LEVEL = {edit}


        class Backend(TritonMLABackend):
            name = "userbk"
    ''') + (LAZY_OVERRIDE if buggy else "")


def userbk_history(guilty=8, broken=5, n=12):
    commits = [("c0 userbk: wrap the Triton backend", {
        "userbk/__init__.py": "", "userbk/backend.py": userbk_source(0, False), "build.sh": "exit 0\n",
        "README": "userbk\n"})]
    for i in range(1, n):
        files = {"userbk/backend.py": userbk_source(i, i >= guilty), "README": f"userbk, revision {i}\n"}
        subject = f"c{i} tweak level {i}"
        if i == guilty:
            subject = f"c{i} plan the scheduler lazily"
        if i == broken:
            files["build.sh"], subject = "echo 'error: missing header' >&2; exit 1\n", f"c{i} break the build"
        if i == broken + 1:
            files["build.sh"] = "exit 0\n"
        commits.append((subject, files))
    return commits


def lazy_repro(backend="userbk.backend:Backend", page_size=16, long_len=120) -> dict:
    """The minimal scenario for the lazy-planning bug: warmup + capture share one build of
    a short batch; the replay of a long batch then runs on the warmup's plan. The decode
    re-derives each request's tile count from the live lengths, so the stale plan shows as
    a different summation (one piece instead of a split): replay != eager in the last bits.
    ``long_len`` must make the two sums differ: at 64-key CPU tiles 100 happened to give
    the same bits, 120 does not."""
    from mla_fuzz.harness.repro import FORMAT
    from mla_fuzz.harness.scenario import ScenarioConfig
    from mla_fuzz.mla_ref import ModelSpec
    cfg = ScenarioConfig(spec=ModelSpec.tiny().to_dict(), capture_sizes=[1], page_size=page_size, max_pages_per_seq=8)
    steps = [
        {"op": "capture", "size": 1, "warmups": 1, "share": True,
         "batch": {"seed": 1, "seq_lens": [3], "q_lens": [1], "max_decode_len": 1}},
        {"op": "replay", "size": 1, "poison": False,
         "batch": {"seed": 2, "seq_lens": [long_len], "q_lens": [1], "max_decode_len": 1}},
    ]
    return {"format": FORMAT, "backend": backend, "graph_mode": "emulated", "config": cfg.to_dict(),
            "steps": steps, "failure": None, "diagnosis": None}


def _real_bisect(tmp_path, capsys, extra, repro_data=None):
    repo = tmp_path / "userrepo"
    shas = make_repo(repo, userbk_history())
    git(repo, "checkout", "-q", "-b", "work", shas[9])       # the user sits on some other commit
    (repo / "userbk" / "backend.py").write_text(userbk_source(42, False))   # with uncommitted edits
    before = snapshot(repo)
    repro = write_repro(tmp_path / "lazy.json", repro_data or lazy_repro())
    out_json = tmp_path / "bisect.json"
    rc = bis.main(["--repo", str(repo), "--good", shas[0], "--bad", shas[-1], "--build", "bash build.sh",
                   "--json", str(out_json), *extra, str(repro)])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out_json.read_text())
    assert res["first_bad"] == shas[8] and res["subject"] == "c8 plan the scheduler lazily"
    # The harness' own explanation of the mutant's bug (harness.mutants.EXPECTED).
    from mla_fuzz.harness.mutants import EXPECTED
    assert res["diagnosis"]["cls"] in EXPECTED["shared-lazy-sched"]
    assert [s["commit"] for s in res["skipped"]] == [shas[5]]
    for s in res["steps"]:
        i = shas.index(s["commit"])
        assert s["verdict"] == ("skip" if i == 5 else "bad" if i >= 8 else "good"), s
        if s["verdict"] != "skip":
            # the revision's module was replayed, from the temporary worktree, not the user's checkout
            mod = Path(s["modules"]["userbk.backend"])
            assert mod.parts[-3:] == ("wt", "userbk", "backend.py") and repo not in mod.parents
    assert f"first bad commit: {shas[8]}" in out and "laziness" in out
    assert snapshot(repo) == before
    return res


def test_bisect_real_replay_names_the_guilty_commit(tmp_path, capsys):
    # End checks are covered with the stand-in; here they would cost two more replays.
    res = _real_bisect(tmp_path, capsys, ["--no-check-ends"])
    assert {s["phase"] for s in res["steps"]} == {"bisect"}


@pytest.mark.gpu
def test_bisect_real_replay_cuda_graphs(tmp_path, capsys):
    """The same bisect with real CUDA graphs and compiled kernels."""
    # GPU tiles are 64 keys and a part takes >= 2 tiles: the replayed row must be long
    # enough for the fresh plan to split it where the warmup's plan did not.
    res = _real_bisect(tmp_path, capsys, ["--graph", "cuda"], lazy_repro(page_size=64, long_len=500))
    assert all(s["attempts"][0]["kind"] != "crash" for s in res["steps"] if s["attempts"])
