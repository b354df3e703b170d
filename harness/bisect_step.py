"""The per-revision runner of ``mla-fuzz bisect``: what ``git bisect run`` calls at each commit.

It is run as a script (``python .../harness/bisect_step.py --config CFG``) with the
temporary worktree, checked out at the revision under test, as its working directory.
It has two halves:

- the **supervisor** (this process; standard library only, so nothing the revision
  breaks can break it): runs the build command, starts the replay child once or more,
  classifies each attempt, takes the majority, appends one JSON line to the step log and
  exits with git's contract: 0 good, 1 bad, 125 skip. Nothing else ever: an exit code
  of 126/127 or >= 128 would abort the whole bisect, so every internal error becomes 125.
- the **replay child** (``--child``): imports the backend *at this revision* and replays
  the repro(s). It runs in its own process so a segfault, an abort or a CUDA error kills
  the child, not the bisect.

Import rule in the child: the worktree (plus any ``--path`` dirs) is first on
``sys.path``, so the revision's modules shadow installed ones, including setuptools
editable installs (their finder is appended to ``sys.meta_path`` and so is consulted
after the path-based one). The tool's own ``mla_fuzz.mla_ref`` and ``mla_fuzz.harness``
(the oracle and the replay machinery) are pinned to the copies of the running tool: the
judge must not change from commit to commit, and old revisions of this very repository
may predate it. ``mla_fuzz.kernels`` (the ``triton`` backend) comes from the revision's
``kernels/`` folder when it has one; revisions from before the ``mla_fuzz`` namespace
import ``mla_ref`` as a top-level name, which is aliased to the pinned oracle.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

EXIT_GOOD, EXIT_BAD, EXIT_SKIP = 0, 1, 125
EXIT_FOR = {"good": EXIT_GOOD, "bad": EXIT_BAD, "skip": EXIT_SKIP}
ON_CRASH = ("bad", "skip")
#: Packages judged by revision must not replace the judge: loaded from the running tool.
PINNED = ("mla_fuzz.mla_ref", "mla_fuzz.harness")
#: The folder that holds the tool's ``mla_ref/``, ``kernels/`` and ``harness/`` (the
#: repository root of a checkout, ``site-packages/mla_fuzz`` of a wheel).
TOOL_ROOT = Path(__file__).resolve().parent.parent
#: Prefix of the one-line progress reports the driver relays to the user.
PROGRESS = "[mla-fuzz-bisect] "

# A CUDA error poisons the context: whatever the oracle said after it is meaningless,
# so it counts as a crash, like death by signal.
_CUDA_ERROR = re.compile(r"CUDA error|cudaError|CUDA_ERROR|illegal memory access|device-side assert|"
                         r"AcceleratorError|CUBLAS_STATUS|CUDNN_STATUS|unspecified launch failure",
                         re.IGNORECASE)


def is_cuda_error(text: str | None) -> bool:
    """Whether an error message names a CUDA (device) error."""
    return bool(text) and bool(_CUDA_ERROR.search(text))


# --------------------------------------------------------------------------- verdicts

def classify_attempt(outcome: dict, on_crash: str) -> tuple[str, str]:
    """Map one replay attempt to a git verdict ``("good" | "bad" | "skip", reason)``.

    ``outcome`` is what ``run_attempt`` returns: ``kind`` is one of ``pass``, ``fail``
    (an oracle failed, a backend exception during a step included), ``crash`` (signal,
    CUDA error, timeout, died without a result) or ``untestable`` (the backend cannot be
    imported, or the replay cannot run, at this revision); ``detail`` says why.
    """
    if on_crash not in ON_CRASH:
        raise ValueError(f"on_crash must be one of {ON_CRASH}, got {on_crash!r}")
    kind, detail = outcome["kind"], outcome.get("detail", "")
    if kind == "pass":
        return "good", "all repros pass"
    if kind == "fail":
        return "bad", detail
    if kind == "untestable":
        return "skip", detail
    if kind == "crash":
        return on_crash, f"crash ({detail}) -> {on_crash} per --on-crash"
    raise ValueError(f"outcome kind must be pass, fail, crash or untestable, got {kind!r}")


def majority(verdicts: list[str], total: int) -> str | None:
    """The verdict held by a strict majority of ``total`` planned attempts, else None.

    Called after each attempt: once a verdict has more than ``total / 2`` votes no
    remaining attempt can overturn it, so the caller stops early.
    """
    if total < 1:
        raise ValueError(f"total must be >= 1, got {total}")
    for v in ("good", "bad", "skip"):
        if verdicts.count(v) * 2 > total:
            return v
    return None


def signal_name(num: int) -> str:
    """``SIGSEGV`` for 11, and so on."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# --------------------------------------------------------------------------- supervisor

def _git(worktree: str, *args: str) -> str:
    """stdout of a git command run in ``worktree`` (C locale, no inherited repo redirects)."""
    env = {k: v for k, v in os.environ.items() if k not in _GIT_REDIRECTS}
    env["LC_ALL"] = "C"
    return subprocess.run(["git", *args], cwd=worktree, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


# Variables that would point git (run from a hook, say) at another repository.
_GIT_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
                  "GIT_PREFIX", "GIT_NAMESPACE")


def child_env(cfg: dict) -> dict:
    """Environment for the build and the replay child: the revision's code first on PYTHONPATH."""
    env = dict(os.environ)
    roots = [str(Path(cfg["worktree"], p)) for p in cfg.get("paths") or ["."]]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(roots + ([old] if old else []))
    # Worktree files change under fixed names between revisions and a checkout can land
    # in the same second with the same size, which would make a cached .pyc look fresh.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")


def run_build(cfg: dict, rev: str, logdir: Path) -> tuple[bool, str]:
    """Run the build command in the worktree; (ok, reason). Its output goes to a log file."""
    log = logdir / f"{rev[:12]}-build.log"
    env = child_env(cfg)
    env["MLA_FUZZ_BISECT_REV"] = rev
    with open(log, "wb") as fh:
        proc = subprocess.run(cfg["build"], shell=True, cwd=cfg["worktree"], env=env, stdout=fh,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        return True, ""
    how = (f"killed by {signal_name(-proc.returncode)}" if proc.returncode < 0
           else f"exit {proc.returncode}")
    last = _tail(log, 400).strip().splitlines()
    return False, f"build failed ({how})" + (f": {last[-1]}" if last else "")


def run_attempt(cfg: dict, rev: str, attempt: int, diagnose: bool, logdir: Path) -> dict:
    """Replay the repro(s) once in a child process; return the outcome dict.

    ``{"kind": pass|fail|crash|untestable, "detail": str, "seconds": float,
    "failure": dict|None, "diagnosis": dict|None, "repro": str|None, "modules": dict}``.
    """
    result_path = logdir / f"{rev[:12]}-{attempt}.result.json"
    log = logdir / f"{rev[:12]}-{attempt}.log"
    result_path.unlink(missing_ok=True)
    cmd = [cfg.get("python") or sys.executable, str(Path(__file__).resolve()), "--child", cfg["config_path"],
           "--result", str(result_path)] + (["--diagnose"] if diagnose else [])
    t0 = time.monotonic()
    timed_out = False
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=cfg["worktree"], env=child_env(cfg), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=cfg.get("timeout"))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        except BaseException:
            # Interrupted (the driver is tearing down): never leave the child running.
            proc.kill()
            proc.wait()
            raise
    out = {"seconds": round(time.monotonic() - t0, 2), "failure": None, "diagnosis": None, "repro": None,
           "modules": {}}
    result = None
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError):
            result = None
    rc = proc.returncode
    if timed_out:
        out.update(kind="crash", detail=f"timed out after {cfg['timeout']}s")
    elif rc < 0:
        out.update(kind="crash", detail=f"replay killed by {signal_name(-rc)}")
    elif result is None:
        out.update(kind="crash", detail=f"replay exited {rc} without a result")
    else:
        out["modules"] = result.get("modules", {})
        status = result.get("status")
        if status == "untestable":
            out.update(kind="untestable", detail=result.get("detail", "backend cannot be loaded"))
        elif status == "error":
            # An exception outside the steps' oracles (backend construction, the harness
            # refusing the scenario): this revision cannot say whether the repro's bug is
            # there -> untestable. A CUDA error is a crash wherever it surfaces.
            detail = result.get("detail", "")
            if is_cuda_error(detail):
                out.update(kind="crash", detail=f"CUDA error: {detail}")
            else:
                out.update(kind="untestable", detail=f"replay could not run: {detail}")
        elif status == "ok":
            failing = [r for r in result.get("results", []) if r.get("failed")]
            if not failing:
                out.update(kind="pass", detail="all repros pass")
            else:
                r = failing[0]
                fail = r.get("failure") or {}
                out.update(failure=fail, diagnosis=r.get("diagnosis"), repro=r.get("repro"))
                msg = fail.get("message", "")
                if is_cuda_error(msg):
                    out.update(kind="crash", detail=f"CUDA error: {msg}")
                else:
                    cls = (r.get("diagnosis") or {}).get("cls")
                    out.update(kind="fail", detail=f"oracle {fail.get('oracle', '?')!r} fired at step {fail.get('step')}"
                               + (f", diagnosis {cls}" if cls else "") + f" ({Path(r.get('repro') or '?').name})")
        else:
            out.update(kind="crash", detail=f"replay wrote an unreadable result (status {status!r})")
    if out["kind"] == "crash":
        tail = _tail(log, 1500)
        if tail:
            out["log_tail"] = tail
    return out


def evaluate(cfg: dict, rev: str, logdir: Path) -> dict:
    """Build + replay (with retries) at the checked-out revision; the log entry for it."""
    t0 = time.monotonic()
    entry: dict = {"verdict": "skip", "reason": "", "attempts": [], "failure": None, "diagnosis": None}
    if cfg.get("build"):
        ok, reason = run_build(cfg, rev, logdir)
        if not ok:
            entry.update(verdict="skip", reason=reason, build_failed=True)
            entry["seconds"] = round(time.monotonic() - t0, 2)
            return entry
    total = int(cfg.get("retries", 0)) + 1
    verdicts: list[str] = []
    decided = None
    for attempt in range(total):
        outcome = run_attempt(cfg, rev, attempt, diagnose=entry["diagnosis"] is None, logdir=logdir)
        verdict, reason = classify_attempt(outcome, cfg.get("on_crash", "bad"))
        outcome.update(verdict=verdict, reason=reason)
        entry["attempts"].append(outcome)
        verdicts.append(verdict)
        if outcome.get("modules"):
            entry["modules"] = outcome["modules"]
        if verdict == "bad" and entry["diagnosis"] is None:
            entry["failure"] = outcome.get("failure")
            entry["diagnosis"] = outcome.get("diagnosis") or (
                {"cls": "crash", "explanation": outcome["detail"], "oracle": "crash"} if outcome["kind"] == "crash"
                else None)
        decided = majority(verdicts, total)
        if decided:
            break
    if decided is None:
        tally = ", ".join(f"{v} x{verdicts.count(v)}" for v in ("good", "bad", "skip") if v in verdicts)
        entry.update(verdict="skip", reason=f"no majority in {total} attempts ({tally}): flaky, skipped")
    else:
        reasons = [a["reason"] for a in entry["attempts"] if a["verdict"] == decided]
        note = "" if len(verdicts) == 1 else f" [{verdicts.count(decided)}/{len(verdicts)} attempts]"
        entry.update(verdict=decided, reason=reasons[0] + note)
    if entry["verdict"] != "bad":
        entry["failure"] = entry["diagnosis"] = None
    entry["seconds"] = round(time.monotonic() - t0, 2)
    return entry


def supervise(config_path: str, phase: str) -> int:
    """Evaluate the revision checked out in the worktree; return 0, 1 or 125 (never else)."""
    rev, subject, cfg = "?", "", {}
    try:
        cfg = json.loads(Path(config_path).read_text())
        cfg["config_path"] = config_path
        logdir = Path(cfg["state"], "logs")
        logdir.mkdir(parents=True, exist_ok=True)
        rev = _git(cfg["worktree"], "rev-parse", "HEAD")
        subject = _git(cfg["worktree"], "log", "-1", "--format=%s", rev)
        entry = evaluate(cfg, rev, logdir)
    except BaseException as exc:  # noqa: BLE001 - any escape would hand git an aborting code
        if isinstance(exc, KeyboardInterrupt):
            raise
        entry = {"verdict": "skip", "reason": f"bisect step error: {type(exc).__name__}: {exc}",
                 "attempts": [], "failure": None, "diagnosis": None,
                 "traceback": traceback.format_exc(limit=8)}
    entry = {"commit": rev, "subject": subject, "phase": phase, "exit": EXIT_FOR[entry["verdict"]], **entry}
    try:
        with open(Path(cfg["state"], "steps.jsonl"), "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    except Exception:  # noqa: BLE001 - the verdict still reaches git through the exit code
        pass
    diag = (entry.get("diagnosis") or {}).get("cls")
    print(f"{PROGRESS}{rev[:10]} {entry['verdict'].upper():4} {subject[:60]!r}: {entry['reason']}"
          + (f" [diagnosis: {diag}]" if diag and diag not in entry["reason"] else "")
          + f" ({entry.get('seconds', 0):.1f}s)", file=sys.stderr, flush=True)
    return entry["exit"]


# --------------------------------------------------------------------------- replay child

def _load_pinned(name: str) -> None:
    """Import the running tool's copy of subpackage ``name`` (``mla_fuzz.X``) whatever
    ``sys.path`` says."""
    pkg = TOOL_ROOT / name.rpartition(".")[2]
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot pin {name} from {pkg}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    setattr(sys.modules["mla_fuzz"], name.rpartition(".")[2], mod)


def _namespace(roots: list[str]) -> None:
    """A fresh ``mla_fuzz`` package whose subpackages are looked up in the revision's
    roots first (its ``kernels/``), then in the tool's."""
    import types
    ns = types.ModuleType("mla_fuzz", "mla-fuzz, assembled for one bisect step")
    ns.__path__ = [*roots, str(TOOL_ROOT)]
    for name in [n for n in sys.modules if n == "mla_fuzz" or n.startswith("mla_fuzz.")]:
        del sys.modules[name]
    sys.modules["mla_fuzz"] = ns


def setup_imports(cfg: dict, pin: bool = True) -> None:
    """Revision first on sys.path, the judge (PINNED) from the tool unless ``pin`` is off."""
    here = str(Path(__file__).resolve().parent)
    # Running as a script puts harness/ itself on sys.path; its modules are not top-level.
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != here]
    roots = [str(Path(cfg["worktree"], p).resolve()) for p in cfg.get("paths") or ["."]]
    sys.path[:0] = [r for r in roots if r not in sys.path[:len(roots)]]
    importlib.invalidate_caches()
    _namespace(roots)
    for name in PINNED if pin else ():
        _load_pinned(name)
    if pin:
        # Revisions from before the namespace import the oracle as ``mla_ref``.
        sys.modules["mla_ref"] = sys.modules["mla_fuzz.mla_ref"]


def _choose_interpreter(cfg: dict) -> None:
    """Kernels on CPU tensors need Triton's interpreter, chosen before ``kernels`` is
    imported (as ``mla-fuzz``'s own commands do). CPU tensors: emulated graphs, or no GPU."""
    if os.environ.get("TRITON_INTERPRET"):
        return
    import torch
    modes = {cfg.get("graph_mode") or r["data"].get("graph_mode") for r in cfg["repros"]}
    if "emulated" in modes or not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _module_files(names) -> dict:
    return {n: getattr(sys.modules.get(n), "__file__", None) for n in names if n in sys.modules}


def _resolve(ref: str):
    mod, _, attr = ref.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def child_main(config_path: str, result_path: str, diagnose: bool) -> int:
    """Replay every repro at this revision; write a JSON result; exit 0 unless killed."""
    cfg = json.loads(Path(config_path).read_text())
    result: dict = {"status": "error", "results": []}

    def write():
        tmp = result_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, result_path)

    try:
        impl = cfg.get("replay_impl")
        setup_imports(cfg, pin=not impl)
        if impl:
            # Test hook: a stand-in replay with the same signature as replay_repro.
            replay = _resolve(impl)
            load = None
        else:
            _choose_interpreter(cfg)
            from mla_fuzz.harness.loading import load_backend as load
            from mla_fuzz.harness.repro import replay_repro as replay
        for item in cfg["repros"]:
            data, ref = item["data"], cfg.get("backend") or item["data"]["backend"]
            if load is not None:
                try:
                    cls = load(ref)
                except Exception as exc:  # noqa: BLE001 - whatever the revision's import raises
                    text = str(exc).splitlines()[0] if str(exc) else ""
                    result.update(status="untestable", detail=f"backend {ref!r} cannot be loaded here: "
                                  f"{type(exc).__name__}: {text}" if not isinstance(exc, ValueError) else text)
                    result["modules"] = _module_files(("mla_fuzz.kernels", *PINNED, ref.partition(":")[0]))
                    write()
                    return 0
                result["modules"] = _module_files(("mla_fuzz.kernels", *PINNED, getattr(cls, "__module__", "")))
            res = replay(data, backend=ref, graph_mode=cfg.get("graph_mode"), diagnose_failure=diagnose)
            failure = res.failure
            diag = res.diagnosis
            result["results"].append({
                "repro": item["path"], "failed": bool(res.failed),
                "failure": None if failure is None else (failure if isinstance(failure, dict) else
                                                         {"oracle": failure.oracle, "step": failure.step,
                                                          "message": failure.message}),
                "diagnosis": None if diag is None else (diag if isinstance(diag, dict) else diag.to_dict()),
            })
            if res.failed:
                break
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the supervisor, which classifies it
        result.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:2000])
        traceback.print_exc()
    write()
    return 0


def probe_main(config_path: str, names: list[str]) -> int:
    """Print where each module is imported from under the child's import rule (for tests)."""
    cfg = json.loads(Path(config_path).read_text())
    setup_imports(cfg)
    for n in names:
        importlib.import_module(n)
    print(json.dumps(_module_files(names + list(PINNED))))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bisect_step", description="per-revision runner of mla-fuzz bisect")
    p.add_argument("--config", help="the bisect's config.json (supervisor mode)")
    p.add_argument("--phase", default="bisect", choices=("bisect", "check", "final"))
    p.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--diagnose", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("modules", nargs="*", help=argparse.SUPPRESS)
    try:
        a = p.parse_args(argv)
    except SystemExit:
        return EXIT_SKIP
    if a.child:
        return child_main(a.child, a.result, a.diagnose)
    if a.probe:
        return probe_main(a.probe, a.modules)
    if not a.config:
        print("bisect_step: --config is required", file=sys.stderr)
        return EXIT_SKIP
    return supervise(a.config, a.phase)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        code = EXIT_SKIP
    sys.exit(code)
