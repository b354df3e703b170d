"""``mla-fuzz replay``: deterministic re-run of repro files, in process or in a worker.

Ordinary repros replay in this process through ``harness.repro.replay_repro``. A repro of
a worker that died or hung (``harness.crash_repro``) replays in a worker process with the
case timeout, so a replay that still crashes is reported, not fatal to the command.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

from .crash_repro import is_process_failure, log_summary
from .pool import Pool, exit_text


@dataclass
class Outcome:
    """The result of replaying one repro: ``failed`` plus what to print."""

    failed: bool
    graph_mode: str
    oracle: str | None = None
    step: int | None = None
    message: str | None = None
    diagnosis: dict | None = None
    isolated: bool = False
    seconds: float = 0.0


def replay_in_process(data: dict, backend: str | None, graph: str | None) -> Outcome:
    from .repro import replay_repro
    res = replay_repro(data, backend=backend, graph_mode=graph)
    if not res.failed:
        return Outcome(False, res.graph_mode)
    f = res.failure
    return Outcome(True, res.graph_mode, f.oracle, f.step, f.message,
                   None if res.diagnosis is None else res.diagnosis.to_dict())


def replay_isolated(data: dict, backend: str | None, graph: str | None, env: dict,
                    case_timeout: float | None) -> Outcome:
    """Replay in one worker process; its death or a step over ``case_timeout`` is the
    outcome (``crash`` / ``hang``), not an error of this command."""
    mode = graph or data["graph_mode"]
    task = {"op": "replay", "id": "replay", "backend": backend or data["backend"], "graph": mode,
            "config": data["config"], "steps": data["steps"], "diagnose": True}
    with tempfile.TemporaryDirectory(prefix="mla-fuzz-replay-") as logs:
        pool = Pool([env], logs, case_timeout=case_timeout)
        pool.start()
        try:
            submitted = False
            while True:
                if not submitted and pool.idle():
                    pool.submit(pool.idle()[0], task)
                    submitted = True
                for ev in pool.poll(0.25):
                    if ev.kind == "fatal":
                        raise RuntimeError(f"worker could not start: {ev.msg.get('error')}\n"
                                           + "\n".join(ev.msg.get("log_tail") or []))
                    if ev.kind == "error":
                        if ev.msg.get("kind") == "input":
                            raise ValueError(ev.msg.get("error"))
                        raise RuntimeError(f"{ev.msg.get('error')}\n{ev.msg.get('traceback') or ''}")
                    if ev.kind == "done":
                        r = ev.msg["result"]
                        f = r.get("failure")
                        if f is None:
                            return Outcome(False, r["graph_mode"], isolated=True)
                        return Outcome(True, r["graph_mode"], f["oracle"], f["step"], f["message"], r.get("diagnosis"),
                                       isolated=True)
                    if ev.kind in ("died", "hung"):
                        inflight = ev.msg.get("inflight") or {}
                        k = max(len(inflight.get("steps") or [None]) - 1, 0)
                        tail = [ln for ln in ev.msg.get("log_tail") or [] if ln.strip()]
                        if ev.kind == "died":
                            msg = f"step {k} killed the worker ({exit_text(ev.msg.get('returncode'))})"
                            if tail:
                                msg += f"; worker log: {log_summary(tail)}"
                            diag = {"cls": "crash", "explanation": msg}
                            return Outcome(True, mode, "worker-died", k, msg, diag, isolated=True)
                        msg = f"step {k} did not finish within {case_timeout:g} s (--case-timeout)"
                        if tail:
                            msg += f"; worker log: {log_summary(tail)}"
                        return Outcome(True, mode, "timeout", k, msg, {"cls": "hang", "explanation": msg},
                                       isolated=True)
        finally:
            pool.close(kill=True)


def replay(data: dict, *, backend: str | None, graph: str | None, isolate: bool | None, env: dict,
           case_timeout: float | None) -> Outcome:
    """Replay ``data`` (a loaded repro); isolated when asked or when the repro is a crash/hang."""
    if isolate is None:
        isolate = is_process_failure(data)
    t0 = time.monotonic()
    out = (replay_isolated(data, backend, graph, env, case_timeout) if isolate
           else replay_in_process(data, backend, graph))
    out.seconds = time.monotonic() - t0
    return out
