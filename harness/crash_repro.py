"""Repros for failures that take the process down: a worker that died or hung mid-step.

Hypothesis cannot shrink these (the process running it is gone), so the campaign builds
the repro from the worker's last in-flight message -- the scenario config and the steps
up to and including the one that never returned -- and then reduces the step list with
``StepReducer``: re-run candidates in a fresh worker and keep a candidate if it still
kills (or hangs) the worker.

Crash repros use the ordinary repro format (``harness.repro``), with failure oracle
``worker-died`` (diagnosis class ``crash``) or ``timeout`` (class ``hang``); ``replay``
runs them in a worker process so that a replay which still crashes cannot take the
command down with it.
"""
from __future__ import annotations

import datetime as _dt

from .repro import FORMAT

ORACLES = {"died": "worker-died", "hung": "timeout"}
CLASSES = {"died": "crash", "hung": "hang"}
PROCESS_ORACLES = frozenset(ORACLES.values())


def is_process_failure(repro: dict) -> bool:
    """True for repros whose replay must run in a separate process (crash or hang)."""
    return (repro.get("failure") or {}).get("oracle") in PROCESS_ORACLES


#: a worker's exit code when a CUDA error poisoned its context (``blame.CudaContextLost``)
CUDA_LOST_EXIT = 70


def _how(kind: str, info: dict, case_timeout: float | None) -> str:
    if kind == "hung":
        return f"did not finish within {case_timeout:g} s (--case-timeout); the worker was killed"
    if info.get("returncode") == CUDA_LOST_EXIT:
        return ("made a CUDA error that poisons the context (illegal memory access, device-side assert, launch "
                "failure); the worker was replaced")
    sig = info.get("signal")
    return f"killed the worker ({'killed by ' + sig if sig else 'exit code ' + str(info.get('returncode'))})"


def crash_repro(kind: str, backend: str, graph_mode: str, info: dict, search: dict,
                case_timeout: float | None = None) -> dict | None:
    """A repro dict for a ``died``/``hung`` pool event, or None when the worker had not yet
    announced a step (nothing to replay).

    ``info`` is the event's message: ``inflight`` (the worker's last ``step`` or ``phase``
    message: ``cfg`` dict, ``steps`` list, and for ``phase`` the ``failure`` being
    diagnosed), ``returncode``, ``signal``, ``log_tail`` (list of str), ``versions``.
    """
    inflight = info.get("inflight")
    if not inflight or not inflight.get("steps"):
        return None
    steps = inflight["steps"]
    evidence = {"returncode": info.get("returncode"), "signal": info.get("signal"),
                "log_tail": info.get("log_tail") or []}
    how = _how(kind, info, case_timeout)
    if inflight.get("t") == "phase":
        # The worker went down while diagnosing a failure it had found: keep that failure,
        # and say that diagnosing it crashed / hung.
        failure = dict(inflight["failure"], evidence=evidence)
        cls = CLASSES[kind]
        explanation = (f"the search found this failure, then a diagnosis re-run of it {how}. "
                       f"[{failure['oracle']}] {failure['message']}")
        oracle = failure["oracle"]
    else:
        k = len(steps) - 1
        message = f"step {k} ({steps[k]['op']}) {how}"
        tail = [ln for ln in evidence["log_tail"] if ln.strip()]
        if tail:
            message += f"; worker log: {log_summary(tail)}"
        # what kind of death, so an abort and an illegal memory access are two findings
        why = ("cuda-context-lost" if info.get("returncode") == CUDA_LOST_EXIT else
               info.get("signal") or f"exit {info.get('returncode')}")
        failure = {"oracle": ORACLES[kind], "step": k, "message": message, "evidence": evidence,
                   "key": ORACLES[kind] if kind == "hung" else f"{ORACLES[kind]}:{why}"}
        cls = CLASSES[kind]
        oracle = ORACLES[kind]
        explanation = (("the backend never returned from this step: an infinite loop, a deadlock, or a kernel "
                        "that does not terminate. ") if kind == "hung" else
                       ("the process running the backend died in this step (abort, segfault, illegal memory "
                        "access, or the OOM killer). ")) + message
    return {
        "format": FORMAT,
        "backend": backend,
        "graph_mode": graph_mode,
        "config": inflight["cfg"],
        "steps": steps,
        "failure": failure,
        "diagnosis": {"cls": cls, "explanation": explanation, "oracle": oracle},
        "search": search,
        "versions": info.get("versions") or {},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def log_summary(lines: list[str]) -> str:
    """The telling part of a dead worker's log excerpt: faulthandler's "Fatal Python error"
    line and/or the innermost Python frame of its stack dump, else the last line."""
    fatal = next((ln.strip() for ln in lines if ln.startswith("Fatal Python error")), None)
    head = next((j for j, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    frame = None
    if head is not None:
        frame = next((ln.strip() for ln in lines[head + 1:] if ln.strip().startswith("File ")), None)
    if fatal or frame:
        return " at ".join(x for x in (fatal, frame) if x)
    return lines[-1].strip()


def valid_steps(steps: list[dict]) -> bool:
    """A replay needs an earlier capture of its size; everything else stands alone."""
    captured = set()
    for s in steps:
        if s["op"] == "capture":
            captured.add(s["size"])
        elif s["op"] == "replay" and s["size"] not in captured:
            return False
    return bool(steps)


class StepReducer:
    """Greedy reduction of a step list that kills its worker; the last step always stays.

    First candidate: the failing step alone (a replay keeps its latest capture); then
    each remaining earlier step is dropped in turn, keeping every drop that still fails
    the same way. ``candidate()`` gives the next list to try (None when done);
    ``result(reproduced)`` reports its outcome.
    """

    def __init__(self, steps: list[dict], max_tries: int = 32):
        self.best = list(steps)
        self.tries = 0
        self.max_tries = max_tries
        self._pending: list[dict] | None = None
        self._i = 0
        self._tail_tried = False
        self._pending_tail = False

    def _tail(self) -> list[dict]:
        last = self.best[-1]
        if last["op"] != "replay":
            return [last]
        for s in reversed(self.best[:-1]):
            if s["op"] == "capture" and s["size"] == last["size"]:
                return [s, last]
        return list(self.best)

    def candidate(self) -> list[dict] | None:
        if self._pending is not None:
            return self._pending
        if self.tries >= self.max_tries:
            return None
        if not self._tail_tried:
            self._tail_tried = True
            tail = self._tail()
            if len(tail) < len(self.best):
                self._pending, self._pending_tail = tail, True
                return tail
        while self._i < len(self.best) - 1:
            cand = self.best[: self._i] + self.best[self._i + 1:]
            if valid_steps(cand):
                self._pending, self._pending_tail = cand, False
                return cand
            self._i += 1
        return None

    def result(self, reproduced: bool) -> None:
        cand, self._pending = self._pending, None
        if cand is None:
            return
        self.tries += 1
        if reproduced:
            self.best = cand
            self._i = 0 if self._pending_tail else self._i
        elif not self._pending_tail:
            self._i += 1
