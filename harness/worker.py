"""The worker process of a campaign: runs fuzz chunks and step lists for its parent.

Started by ``harness.pool`` as ``python -m mla_fuzz.harness.worker --fd N``, or forked by the
zygote (``harness.zygote``) that calls ``main(["--fd", N])``, with its environment
(``CUDA_VISIBLE_DEVICES``, ``TRITON_INTERPRET``, thread counts) already set, so the choice of
GPU is made before CUDA is first used here. After every task it gives torch's cached GPU
memory back, so that an idle worker holds none of what its neighbours need.

Protocol: tasks arrive as JSON lines on stdin; messages go as JSON lines to file
descriptor ``N`` -- not stdout, which a backend may print to (stdout and stderr are the
worker's log). Before every step the worker sends the scenario so far (``step``), and
before a diagnosis the failure being diagnosed (``phase``): if the step then kills the
process (abort, segfault, illegal memory access, OOM kill) or never returns, the parent
already knows exactly what was running and turns it into a repro. The moment a fuzz chunk
first sees a failure, before Hypothesis shrinks it, the worker sends it (``found``, with its
unshrunk repro), so the parent reports it at once and the shrunk repro replaces it later.

Tasks:
- ``{"op": "fuzz", "id", "backend", "graph", "spec", "examples", "seed", "budget_s", "shrink"}``
  -> ``found`` (at most once: ``repro`` unshrunk and undiagnosed, ``examples_to_detect``,
  ``seconds_to_detect`` from the chunk's start, ``time``), then ``done`` with ``report`` (a
  ``FuzzReport`` as a dict);
- ``{"op": "replay", "id", "backend", "graph", "config", "steps", "diagnose"}``
  -> ``done`` with ``result`` (failure and diagnosis, or none);
- ``{"op": "warmup", "id", "backend", "graph", "config", "steps", "name"}`` (``harness.warmup``)
  -> ``done`` with ``outcome`` (``status`` ok / unsupported / failed, ``message``, ``seconds``);
  a failure here is the warmup's warning, never a finding;
- ``{"op": "exit"}``.
Any exception becomes ``error`` with ``kind`` ``input`` (ValueError: a bad backend
reference, spec or repro) or ``internal``; the GPU running out of memory (``blame.DeviceOutOfMemory``)
becomes ``error`` with ``kind`` ``oom`` once the worker has freed what it held, for the parent
to run the task again with fewer beside it (``harness.throttle``). A task with ``"alone": true``
has the GPU to itself: there an out-of-memory error is the backend's own, a finding.

Signals: SIGUSR1 asks the running fuzz chunk to stop at its next step (Ctrl-C in the
parent); SIGUSR2 dumps every thread's Python stack to the log (the parent sends it to a
worker it is about to kill for a hang, so the hang repro says where it was stuck).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
import traceback

from .procs import pid_alive

_FD = -1
_STOP = False
_PARENT = os.getppid()
# the command that owns this worker: the parent, unless the worker was forked by the pool's
# zygote (``harness.zygote``), whose parent the command is
_OWNER = int(os.environ.get("MLA_FUZZ_OWNER_PID") or 0)


def send(msg: dict) -> None:
    """Write one JSON line to the parent. A write may be split by a signal handler, hence
    the loop; a closed pipe means the parent is gone, so the worker leaves at once."""
    data = (json.dumps(msg, separators=(",", ":"), default=str) + "\n").encode()
    try:
        while data:
            n = os.write(_FD, data)
            data = data[n:]
    except (BrokenPipeError, OSError):
        os._exit(0)


def _on_stop(signum, frame) -> None:
    global _STOP
    _STOP = True


# bound in main() once the harness imports (this module's top imports only the stdlib)
CudaContextLost = is_cuda_error = blame = None


def _free_device_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _lost(message: str) -> None:
    """The CUDA context is poisoned: say so in the log the parent reads and exit, so the
    parent records a crash for the step in flight and starts a fresh worker."""
    first = message.strip().splitlines()[0] if message.strip() else "CUDA error"
    sys.stderr.write(f"mla-fuzz worker: CUDA context lost, exiting: {first}\n")
    sys.stderr.flush()
    os._exit(CudaContextLost.EXIT_CODE)


def _check_parent() -> None:
    # An orphaned worker (its command killed with -9) must not keep a GPU busy.
    gone = not pid_alive(_OWNER) if _OWNER else os.getppid() != _PARENT
    if gone:
        os._exit(0)


def _fuzz_task(task: dict) -> dict:
    """Run one ``harness.fuzz.fuzz`` chunk with the in-flight hooks installed."""
    from mla_fuzz.harness import fuzz as fuzz_mod
    from mla_fuzz.harness.oracles import failure_dict

    tid = task["id"]
    budget_s = task.get("budget_s")

    def on_step(cfg, steps, shrinking=False) -> None:
        # steps == [] announces a new scenario (its backend is about to be built); shrink
        # re-runs are flagged so the parent's live counts add up to the report's
        _check_parent()
        send({"t": "step", "task": tid, "cfg": cfg.to_dict(), "steps": steps, "time": time.time(),
              "shrinking": bool(shrinking)})

    def on_phase(phase, info) -> None:
        # Diagnosis re-runs the scenario without the step hook; tell the parent which
        # failure it is working on, so a crash or hang in a re-run still yields a repro.
        f = info["failure"]
        send({"t": "phase", "task": tid, "phase": phase, "cfg": info["cfg"].to_dict(), "steps": info["steps"],
              "failure": failure_dict(f), "time": time.time()})

    def on_found(repro, info) -> None:
        # the first failure as seen, before shrinking: the parent reports it now
        _check_parent()
        send({"t": "found", "task": tid, "repro": repro, "time": time.time(), **info})

    def on_declined(cfg) -> None:
        # the scenario just announced does not count: the parent's live counts take it back
        send({"t": "step", "task": tid, "cfg": cfg.to_dict(), "steps": [], "declined": True, "time": time.time(),
              "shrinking": False})

    report = fuzz_mod.fuzz(task["backend"], spec=task.get("spec", "tiny"), graph_mode=task.get("graph", "auto"),
                           examples=int(task["examples"]), seed=int(task["seed"]), budget_s=budget_s,
                           shrink=bool(task.get("shrink", True)), on_step=on_step, on_phase=on_phase,
                           should_stop=lambda: _STOP, on_found=on_found, on_declined=on_declined,
                           shrink_seconds=task.get("shrink_seconds"),
                           narrow=task.get("narrow") or None, known=task.get("known") or (),
                           strict_contiguity=bool(task.get("strict_contiguity")),
                           max_seq_len=task.get("max_seq_len"))
    return {"report": {
        "backend": report.backend, "graph_mode": report.graph_mode, "seed": report.seed,
        "examples": report.examples, "steps": report.steps, "seconds": report.seconds,
        "shrink_runs": report.shrink_runs, "shrink_seconds": report.shrink_seconds,
        "diagnose_seconds": report.diagnose_seconds,
        "examples_to_detect": report.examples_to_detect, "seconds_to_detect": report.seconds_to_detect,
        "repro": report.repro, "coverage": report.coverage, "unsupported": report.unsupported,
        "capabilities": report.capabilities, "stopped": _STOP}}


def _replay_task(task: dict) -> dict:
    """Run a step list in order (crash reduction, isolated replay), one ``step`` message
    before each step, then diagnose a failure if asked."""
    from mla_fuzz.harness.diagnosis import diagnose
    from mla_fuzz.harness.executor import ScenarioRunner, StepUnsupported
    from mla_fuzz.harness.fuzz import resolve_mode
    from mla_fuzz.harness.loading import load_backend
    from mla_fuzz.harness.oracles import OracleFailure, failure_dict
    from mla_fuzz.harness.scenario import ScenarioConfig, validate_step

    tid = task["id"]
    backend_cls = load_backend(task["backend"])
    cfg = ScenarioConfig.from_dict(task["config"])
    steps = task["steps"]
    for s in steps:
        validate_step(s, cfg)
    runner = None
    mode = resolve_mode(task.get("graph", "auto"))
    failure = None
    try:
        runner = ScenarioRunner(backend_cls, cfg, task.get("graph", "auto"))
        _apply_steps(runner, task, steps)
    except OracleFailure as f:
        failure = f
    except StepUnsupported:
        pass  # the backend declined the input: nothing wrong was seen
    finally:
        if runner is not None:
            runner.close()
    result = {"graph_mode": mode, "failure": None, "diagnosis": None}
    if failure is not None:
        result["failure"] = failure_dict(failure)
        if task.get("diagnose"):
            send({"t": "phase", "task": tid, "phase": "diagnose", "cfg": task["config"], "steps": steps,
                  "failure": result["failure"], "time": time.time()})
            result["diagnosis"] = diagnose(backend_cls, cfg, steps, failure, mode).to_dict()
    return {"result": result}


def _apply_steps(runner, task: dict, steps: list[dict]) -> None:
    """Apply ``steps`` in order, telling the parent about each before it runs (so a step that
    kills or hangs this process is attributed to it)."""
    for i, step in enumerate(steps):
        _check_parent()
        send({"t": "step", "task": task["id"], "cfg": task["config"], "steps": steps[: i + 1], "time": time.time()})
        runner.apply(step)


def _warmup_task(task: dict) -> dict:
    """Run one warmup scenario (``harness.warmup``) to compile the kernel variants it reaches:
    a ``step`` message before each step (a crash or hang is still attributed), the outcome
    as a status, never a diagnosis. A CUDA error poisons the context: the worker exits (as
    in a fuzz chunk) and the parent warns about the scenario."""
    from mla_fuzz.harness.executor import ScenarioRunner, StepUnsupported
    from mla_fuzz.harness.loading import load_backend
    from mla_fuzz.harness.oracles import OracleFailure
    from mla_fuzz.harness.scenario import ScenarioConfig, validate_step

    tid = task["id"]
    t0 = time.time()
    backend_cls = load_backend(task["backend"])
    cfg = ScenarioConfig.from_dict(task["config"])
    steps = task["steps"]
    for s in steps:
        validate_step(s, cfg)
    status, message, runner = "ok", None, None
    try:
        runner = ScenarioRunner(backend_cls, cfg, task.get("graph", "auto"))
        _apply_steps(runner, task, steps)
    except OracleFailure as f:
        if f.oracle != "bounds" and is_cuda_error(f.message):
            raise CudaContextLost(f"step {f.step}: {f.message}") from None
        status, message = "failed", f"[{f.oracle}] at step {f.step}: {' '.join(str(f.message).split())[:300]}"
    except StepUnsupported as u:
        status, message = "unsupported", u.reason
    finally:
        if runner is not None:
            runner.close()
    return {"outcome": {"status": status, "message": message, "seconds": round(time.time() - t0, 3)}}


def _versions() -> dict:
    try:
        from mla_fuzz.harness.repro import versions
        return versions()
    except Exception as exc:  # the repro module may not import in a broken install
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    global _FD, _STOP
    ap = argparse.ArgumentParser(prog="python -m mla_fuzz.harness.worker")
    ap.add_argument("--fd", type=int, required=True, help="file descriptor for messages to the parent")
    args = ap.parse_args(argv)
    _FD = args.fd
    # Fatal signals (abort, segfault) dump the Python stack into the log the parent reads.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
    signal.signal(signal.SIGUSR1, _on_stop)
    # The terminal's Ctrl-C goes to the parent's process group only; ignore a stray one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get("MLA_FUZZ_CUDA_EARLY") == "1":  # set by the parent for GPU workers only
        from mla_fuzz.harness.cuda_early import open_primary_context
        open_primary_context()
    try:
        import importlib

        import torch  # (import cost is paid before 'ready', not inside a task)
        importlib.import_module("mla_fuzz.harness.fuzz")
        global CudaContextLost, is_cuda_error, blame
        from mla_fuzz.harness import blame
        from mla_fuzz.harness.blame import CudaContextLost, is_cuda_error
        threads = os.environ.get("MLA_FUZZ_TORCH_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
    except BaseException as exc:
        send({"t": "fatal", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 3
    send({"t": "ready", "pid": os.getpid(), "versions": _versions(),
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        task = json.loads(line)
        if task.get("op") == "exit":
            break
        _STOP = False
        t0 = time.time()
        # a task the parent runs alone owns the GPU: an out-of-memory error there is the backend's
        blame.OOM_IS_ENVIRONMENT = not task.get("alone")
        oom = None
        try:
            body = {"fuzz": _fuzz_task, "replay": _replay_task, "warmup": _warmup_task}[task["op"]](task)
            send({"t": "done", "task": task["id"], "wall": time.time() - t0, **body})
        except CudaContextLost as exc:
            _lost(str(exc))
        except blame.DeviceOutOfMemory as exc:
            oom = str(exc)
        except Exception as exc:
            found = blame.out_of_memory(exc)
            if found is None and is_cuda_error(f"{type(exc).__name__}: {exc}"):
                _lost(f"{type(exc).__name__}: {exc}")
            if found is not None:
                oom = blame.first_line(found)
            else:
                kind = "input" if isinstance(exc, ValueError) else "internal"
                send({"t": "error", "task": task.get("id"), "kind": kind, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()})
        # the task's tensors are garbage once its frames are gone: hand the memory torch keeps
        # cached back to the GPU, so that an idle worker holds none of what others need
        _free_device_memory()
        if oom is not None:
            send({"t": "error", "task": task.get("id"), "kind": "oom", "error": f"out of GPU memory: {oom}"})
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
