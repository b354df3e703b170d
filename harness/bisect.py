"""``mla-fuzz bisect``: find the first commit at which a repro fails, with ``git bisect run``.

The bisect runs in a temporary detached worktree (``git worktree add --detach``) so the
user's checkout -- working tree, index, HEAD, branches, stash and any bisect of their
own (bisect state is per worktree) -- is never touched; the worktree is reset and
removed at the end, also on Ctrl-C or SIGTERM. At each revision git calls
``harness/bisect_step.py`` (build, replay in a child process, verdict as exit code).

Before bisecting, both ends are checked (``--no-check-ends`` to skip): a repro that
passes at ``--bad`` or fails at ``--good`` makes any answer meaningless.

Exit status: 0 first bad commit found; 1 no single answer (only skipped commits left,
an end misbehaves, git failed); 2 bad arguments or a malformed repro; 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import bisect_step as step

PROG = "mla-fuzz bisect"
DESCRIPTION = ("Find the first commit at which the repro(s) fail: drives git bisect run in a temporary worktree "
               "(your checkout, branches, stash and bisect state are never touched). Exit 0 found, 1 no single "
               "answer, 2 usage error or malformed repro, 130 interrupted.")
_SHA = re.compile(r"^([0-9a-f]{40,64})\b")


# Wraps the runner for git: keeps git's contract even if the runner itself dies (OOM
# kill, a Python that cannot start): anything but 0/1/125 becomes 125 (skip) instead of
# an exit code that would abort the bisect.
STEP_GUARD = '"$@"; rc=$?; case $rc in 0|1|125) exit $rc;; esac; exit 125'


class UsageError(ValueError):
    """Bad arguments or input files: reported in one line, exit 2, before anything starts."""


class _Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception so that ``finally`` cleans up."""


# --------------------------------------------------------------------------- arguments

def add_bisect_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bisect`` on an ``argparse`` subparsers object; returns the parser."""
    p = subparsers.add_parser("bisect", help="find the commit that broke a repro (drives git bisect run)",
                              description=DESCRIPTION)
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bisect`` arguments to ``p`` (shared by the subcommand and ``python -m``)."""
    p.add_argument("repros", nargs="+", metavar="REPRO.json", help="repro file(s); a revision is bad if any fails")
    p.add_argument("--good", required=True, metavar="REV", help="a revision where the repro(s) pass")
    p.add_argument("--bad", required=True, metavar="REV", help="a later revision where they fail")
    p.add_argument("--repo", default=".", metavar="PATH", help="the git repository to bisect (default: .)")
    p.add_argument("--build", metavar="CMD",
                   help="shell command run in the worktree at each revision before the replay; "
                        "a failure skips the revision (exit 125). Build in place; do not pip-install")
    p.add_argument("--backend", metavar="REF",
                   help="replay against this backend instead of the repro's: 'triton', 'mutant:NAME' or "
                        "'pkg.mod:Class' (imported from the revision under test)")
    p.add_argument("--graph", dest="graph_mode", choices=("auto", "cuda", "emulated", "eager"),
                   help="replay in this graph mode instead of the repro's")
    p.add_argument("--on-crash", choices=step.ON_CRASH, default="bad",
                   help="verdict for a replay killed by a signal, a CUDA error or a timeout (default: bad)")
    p.add_argument("--retries", type=int, default=0, metavar="N",
                   help="replay each revision up to N+1 times, majority wins; no majority -> skip (default 0)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="per replay attempt; over it counts as a crash")
    p.add_argument("--path", dest="paths", action="append", metavar="DIR",
                   help="import root inside the repo, first on sys.path (repeatable; default: the repo root)")
    p.add_argument("--no-check-ends", dest="check_ends", action="store_false",
                   help="do not confirm that --good passes and --bad fails before bisecting")
    p.add_argument("--json", metavar="FILE", help="write the result (first bad, diagnosis, skipped, steps) as JSON")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the per-revision build/replay logs to DIR")
    p.add_argument("-v", "--verbose", action="store_true", help="also show git's own output")
    # Test hook: replace harness.repro.replay_repro with 'module:function' in the child.
    p.add_argument("--replay-impl", help=argparse.SUPPRESS)
    return p


def _git(repo, *args, check=True, capture=True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in step._GIT_REDIRECTS}
    env["LC_ALL"] = "C"
    return subprocess.run(["git", *args], cwd=repo, env=env, text=True, check=check,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.PIPE if capture else subprocess.DEVNULL)


def _rev(repo: str, rev: str, flag: str) -> str:
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise UsageError(f"{flag} {rev!r} is not a commit in {repo}")
    return r.stdout.strip()


def _check_backend_ref(ref: str) -> None:
    if ref == "triton" or ref.startswith("mutant:"):
        return
    mod, sep, attr = ref.partition(":")
    ident = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
    if not (sep and ident.match(mod) and ident.match(attr)):
        raise UsageError(f"--backend must be 'triton', 'mutant:NAME' or 'package.module:Class', got {ref!r}")


def validate(args) -> dict:
    """Check every argument and load every repro; the bisect config. UsageError if wrong."""
    if shutil.which("git") is None:
        raise UsageError("git is not installed (needed for bisect)")
    if args.retries is None or args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.build is not None and not args.build.strip():
        raise UsageError("--build must be a non-empty shell command")
    if args.backend is not None:
        _check_backend_ref(args.backend)
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--json {args.json!r}: directory {str(parent)!r} does not exist")
    if not Path(args.repo).is_dir():
        raise UsageError(f"--repo {args.repo!r} is not a directory")
    top = _git(args.repo, "rev-parse", "--show-toplevel", check=False)
    if top.returncode != 0:
        raise UsageError(f"--repo {args.repo!r} is not inside a git work tree")
    repo = top.stdout.strip()
    good, bad = _rev(repo, args.good, "--good"), _rev(repo, args.bad, "--bad")
    if good == bad:
        raise UsageError(f"--good and --bad are the same commit ({good[:12]})")
    if _git(repo, "merge-base", "--is-ancestor", good, bad, check=False).returncode != 0:
        raise UsageError(f"--good {args.good!r} is not an ancestor of --bad {args.bad!r}")
    for d in args.paths or []:
        if os.path.isabs(d) or ".." in Path(d).parts:
            raise UsageError(f"--path must be a directory relative to the repo root, got {d!r}")

    from .repro import ReproError, load_repro
    repros = []
    for path in args.repros:
        try:
            data = load_repro(path)
        except ReproError as exc:
            raise UsageError(f"malformed repro: {exc}") from None
        if args.backend is None:
            try:
                _check_backend_ref(data["backend"])
            except UsageError:
                raise UsageError(f"malformed repro: {path}: backend {data['backend']!r} is not 'triton', "
                                 "'mutant:NAME' or 'package.module:Class'") from None
        # The file's content is captured now: a repro kept inside the repo must not
        # change under the bisect as revisions are checked out.
        repros.append({"path": str(Path(path).resolve()), "data": data})
    return {"repo": repo, "good": good, "bad": bad, "repros": repros, "backend": args.backend,
            "graph_mode": args.graph_mode, "build": args.build, "on_crash": args.on_crash, "retries": args.retries,
            "timeout": args.timeout, "paths": args.paths or ["."], "replay_impl": args.replay_impl,
            "python": sys.executable}


# --------------------------------------------------------------------------- running

class Bisection:
    """One bisect session: worktree, config, processes; ``close()`` undoes everything."""

    def __init__(self, cfg: dict, verbose: bool = False, out=None):
        self.cfg = cfg
        self.verbose = verbose
        self.out = out or sys.stdout
        self.repo = cfg["repo"]
        self.state = Path(tempfile.mkdtemp(prefix="mla-fuzz-bisect-"))
        self.worktree = self.state / "wt"
        self.proc: subprocess.Popen | None = None
        self.bisecting = False
        self.git_output: list[str] = []
        self.bisect_log = ""
        cfg.update(state=str(self.state), worktree=str(self.worktree))
        self.config_path = self.state / "config.json"
        self.config_path.write_text(json.dumps(cfg))

    def say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def open(self) -> None:
        _git(self.repo, "worktree", "add", "--detach", str(self.worktree), self.cfg["bad"])

    def _stream(self, cmd: list[str], keep: bool) -> int:
        """Run ``cmd`` in the worktree in its own process group, relaying progress lines."""
        env = {k: v for k, v in os.environ.items() if k not in step._GIT_REDIRECTS}
        env["LC_ALL"] = "C"
        # A session of its own: on Ctrl-C/SIGTERM we kill the whole group (git, the step,
        # the replay child) ourselves, after which the cleanup can run undisturbed.
        self.proc = subprocess.Popen(cmd, cwd=self.worktree, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                     errors="replace", start_new_session=True)
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if keep:
                self.git_output.append(line)
            if line.startswith(step.PROGRESS):
                self.say("  " + line[len(step.PROGRESS):])
            elif self.verbose:
                self.say("  git: " + line)
        rc = self.proc.wait()
        self.proc = None
        return rc

    def step_cmd(self, phase: str) -> list[str]:
        return [sys.executable, str(Path(step.__file__).resolve()), "--config", str(self.config_path),
                "--phase", phase]

    def test_at(self, sha: str, phase: str) -> int:
        """Run the per-revision step at ``sha`` outside git bisect; its exit code."""
        _git(self.worktree, "checkout", "--detach", "--quiet", "--force", sha)
        return self._stream(self.step_cmd(phase), keep=False)

    def run(self) -> int:
        """git bisect start + run; the exit code of ``git bisect run``."""
        _git(self.worktree, "bisect", "start", self.cfg["bad"], self.cfg["good"])
        self.bisecting = True
        rc = self._stream(["git", "bisect", "run", "sh", "-c", STEP_GUARD, "mla-fuzz-bisect-step",
                           *self.step_cmd("bisect")], keep=True)
        self.bisect_log = _git(self.worktree, "bisect", "log", check=False).stdout
        return rc

    def steps(self) -> list[dict]:
        path = self.state / "steps.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def kill(self) -> None:
        """Stop the running git/step/replay process group: SIGTERM, after 5 s SIGKILL."""
        proc = self.proc
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        # Wait for the whole group, not only git: the replay child must be gone before
        # its worktree is removed.
        while time.monotonic() - t0 < 10.0:
            if proc.poll() is not None and not _group_alive(proc.pid):
                break
            if time.monotonic() - t0 > 5.0:
                _signal_group(proc.pid, signal.SIGKILL)
            time.sleep(0.05)

    def close(self, keep_logs: str | None = None) -> list[str]:
        """Stop processes, ``git bisect reset``, remove the worktree; problems left, if any."""
        problems = []
        self.kill()
        if self.worktree.exists():
            if self.bisecting:
                # A killed checkout can leave index.lock behind, which blocks the reset.
                lock = _git(self.worktree, "rev-parse", "--git-path", "index.lock", check=False).stdout.strip()
                if lock:
                    Path(self.worktree, lock).unlink(missing_ok=True)
                r = _git(self.worktree, "bisect", "reset", check=False)
                if r.returncode != 0:
                    problems.append(f"git bisect reset: {r.stderr.strip()}")
            r = _git(self.repo, "worktree", "remove", "--force", "--force", str(self.worktree), check=False)
            if r.returncode != 0:
                shutil.rmtree(self.worktree, ignore_errors=True)
        _git(self.repo, "worktree", "prune", check=False)
        if keep_logs and (self.state / "logs").is_dir():
            shutil.copytree(self.state / "logs", keep_logs, dirs_exist_ok=True)
        shutil.rmtree(self.state, ignore_errors=True)
        if self.worktree.exists():
            problems.append(f"could not remove the worktree {self.worktree}")
        return problems


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left, or the id was reused
        return False


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: orphans
    (the replay child of a killed step) wait for init to reap them, which may be slow."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return _signal_group(pgid, 0)
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def parse_outcome(lines: list[str]) -> tuple[str | None, list[str]]:
    """From ``git bisect run`` output: (first bad sha or None, candidate shas if ambiguous)."""
    for line in lines:
        m = re.match(r"^([0-9a-f]{40,64}) is the first bad commit", line)
        if m:
            return m.group(1), [m.group(1)]
    cands, inside = [], False
    for line in lines:
        if "first bad commit could be any of" in line:
            inside = True
            continue
        if inside:
            m = _SHA.match(line.strip())
            if m:
                cands.append(m.group(1))
            elif cands:
                break
    return None, cands


def _subject(repo: str, sha: str) -> str:
    return _git(repo, "log", "-1", "--format=%s", sha, check=False).stdout.strip()


def _drive(b: Bisection, cfg: dict, result: dict, check_ends: bool) -> None:
    """End checks, then git bisect run; fills ``result`` in place."""
    b.open()
    n = int(_git(cfg["repo"], "rev-list", "--count", f"{cfg['good']}..{cfg['bad']}").stdout)
    b.say(f"bisecting {n} commit(s) in {cfg['repo']}: good {cfg['good'][:10]} .. bad {cfg['bad'][:10]}")
    if check_ends:
        rc = b.test_at(cfg["bad"], "check")
        if rc != step.EXIT_BAD:
            why = "passes" if rc == step.EXIT_GOOD else "cannot be tested (skipped)"
            result["message"] = f"the repro {why} at --bad {cfg['bad'][:12]}: nothing to bisect"
            return
        rc = b.test_at(cfg["good"], "check")
        if rc == step.EXIT_BAD:
            result["message"] = f"the repro already fails at --good {cfg['good'][:12]}"
            return
        if rc == step.EXIT_SKIP:
            b.say("  warning: --good cannot be tested (skipped); taking it as good")
    rc = b.run()
    first, cands = parse_outcome(b.git_output)
    if first:
        result.update(result="found", first_bad=first, candidates=[first])
        # git never tests --bad itself; with the end check off its diagnosis may be missing.
        if not any(s["commit"] == first and s["verdict"] == "bad" for s in b.steps()):
            _git(b.worktree, "bisect", "reset", check=False)
            b.bisecting = False
            b.test_at(first, "final")
    elif cands:
        result.update(result="ambiguous", candidates=cands,
                      message=f"only skipped commits left: the first bad commit is one of {len(cands)}")
    else:
        tail = "\n".join(b.git_output[-5:])
        result["message"] = f"git bisect run ended (exit {rc}) without an answer:\n{tail}"


def bisect(cfg: dict, *, check_ends: bool = True, verbose: bool = False, keep_logs: str | None = None,
           out=None) -> dict:
    """Run the whole bisect described by ``cfg`` (from ``validate``); the result dict.

    ``{"result": "found" | "ambiguous" | "error", "first_bad", "subject", "diagnosis",
    "candidates", "skipped", "steps", "message", ...}``. Raises KeyboardInterrupt on
    Ctrl-C (and SIGTERM/SIGHUP, turned into one) after cleaning up.
    """
    t0 = time.monotonic()
    out = out or sys.stdout
    result = {"result": "error", "first_bad": None, "subject": None, "diagnosis": None, "failure": None,
              "candidates": [], "skipped": [], "steps": [], "message": "", "repo": cfg["repo"],
              "good": cfg["good"], "bad": cfg["bad"], "repros": [r["path"] for r in cfg["repros"]],
              "backend": cfg["backend"] or sorted({r["data"]["backend"] for r in cfg["repros"]})}
    b = Bisection(dict(cfg), verbose=verbose, out=out)
    problems: list[str] = []
    handlers = _install_signal_handlers()
    try:
        _drive(b, cfg, result, check_ends)
    except subprocess.CalledProcessError as exc:
        result["message"] = f"{' '.join(map(str, exc.cmd))} failed: {(exc.stderr or '').strip()}"
    finally:
        result["steps"] = b.steps()
        result["bisect_log"] = b.bisect_log
        _ignore_signals()
        try:
            problems = b.close(keep_logs)
        finally:
            _restore_signals(handlers)
    if problems:
        result["cleanup_problems"] = problems
    seen = set()
    for s in result["steps"]:
        if s["verdict"] == "skip" and s["commit"] not in seen:
            seen.add(s["commit"])
            result["skipped"].append({"commit": s["commit"], "subject": s["subject"], "reason": s["reason"]})
    if result["first_bad"]:
        result["subject"] = _subject(cfg["repo"], result["first_bad"])
        at = [s for s in result["steps"] if s["commit"] == result["first_bad"] and s["verdict"] == "bad"]
        if at:
            result["diagnosis"], result["failure"] = at[-1].get("diagnosis"), at[-1].get("failure")
    result["candidates"] = [{"commit": c, "subject": _subject(cfg["repo"], c)} for c in result["candidates"]]
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


_CAUGHT = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def _install_signal_handlers():
    try:
        return {s: signal.signal(s, _raise_terminated) for s in _CAUGHT}
    except ValueError:  # not the main thread: the caller owns signal handling
        return None


def _ignore_signals():
    try:
        for s in (*_CAUGHT, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
    except ValueError:
        pass


def _restore_signals(handlers):
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s, h in (handlers or {}).items():
            signal.signal(s, h)
    except ValueError:
        pass


# --------------------------------------------------------------------------- reporting

def format_result(r: dict) -> str:
    lines = []
    if r["result"] == "found":
        lines.append(f"first bad commit: {r['first_bad']}")
        lines.append(f"  {r['subject']}")
        d = r.get("diagnosis")
        if d:
            lines.append(f"diagnosis there: {d.get('cls')} (oracle: {d.get('oracle')})")
            if d.get("explanation"):
                lines.append(f"  {d['explanation']}")
        elif r.get("failure"):
            lines.append(f"failure there: {r['failure'].get('oracle')}: {r['failure'].get('message')}")
    elif r["result"] == "ambiguous":
        lines.append(f"no single answer: {r['message']}")
        lines += [f"  {c['commit'][:12]} {c['subject']}" for c in r["candidates"]]
    else:
        lines.append(f"bisect failed: {r['message']}")
    if r["skipped"]:
        lines.append(f"skipped {len(r['skipped'])} revision(s):")
        lines += [f"  {s['commit'][:12]} {s['subject']}: {s['reason']}" for s in r["skipped"]]
    tested = len({s["commit"] for s in r["steps"]})
    lines.append(f"tested {tested} revision(s) in {r.get('seconds', 0):.0f}s")
    for p in r.get("cleanup_problems", []):
        lines.append(f"warning: cleanup: {p}")
    return "\n".join(lines)


def run_bisect(args) -> int:
    """Entry point for ``mla-fuzz bisect`` (``args`` from ``add_bisect_parser``); exit status."""
    try:
        cfg = validate(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = bisect(cfg, check_ends=args.check_ends, verbose=args.verbose, keep_logs=args.keep_logs)
    except (KeyboardInterrupt, _Terminated):
        print(f"{PROG}: interrupted; worktree and bisect state cleaned up", file=sys.stderr)
        return 130
    print(format_result(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return {"found": 0}.get(result["result"], 1)


def main(argv: list[str] | None = None) -> int:
    """``python -m mla_fuzz.harness.bisect ...`` (same arguments as ``mla-fuzz bisect``)."""
    p = configure_parser(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION))
    return run_bisect(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
