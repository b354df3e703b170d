"""Worker processes for a campaign: start, feed, watch, restart.

Each worker runs ``mla_fuzz.harness.worker`` (see there for the protocol) in its own session,
with its own environment: one GPU each via ``CUDA_VISIBLE_DEVICES``, set before its first CUDA
call. It is forked by the process's zygote (``harness.zygote``: torch and friends imported
once, CUDA never touched), or, when that is off or cannot start, started fresh with
``subprocess`` (``Pool.launcher`` says which, and why). Because it has its
own session, the terminal's Ctrl-C reaches only the parent, which then stops the workers
in an orderly way. A reader thread per worker turns its message pipe into events on one
queue.

The pool notices a worker that dies (any exit or signal: abort, segfault, the OOM killer)
or whose current step outlives the case timeout (it is then sent SIGUSR2 to dump its
stack into its log, and killed), reports it as a ``died`` / ``hung`` event carrying the
last in-flight message and the tail of the worker's log, and starts a replacement.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Importing torch (and, on a GPU box, initialising CUDA) can take a while on a loaded host.
STARTUP_TIMEOUT_S = 180.0
# A diagnosis re-runs the failing scenario a handful of times without the step hook.
DIAGNOSE_FACTOR = 10.0
# Between SIGUSR2 (stack dump) and SIGKILL of a hung worker.
DUMP_GRACE_S = 0.5
LOG_TAIL_LINES = 30


@dataclass
class Event:
    """What happened in the pool.

    ``kind``: ``ready`` | ``step`` | ``phase`` | ``found`` | ``done`` | ``error`` | ``died`` |
    ``hung`` | ``fatal`` (a worker that cannot start). ``msg`` is the worker's message; for ``died`` and
    ``hung`` it is ``{"inflight": last step/phase message or None, "returncode", "signal",
    "log_tail", "seconds"}``. ``task`` is the task the worker was running, if any.
    """

    kind: str
    slot: int
    task: dict | None
    msg: dict = field(default_factory=dict)


class Worker:
    """One slot of the pool: the current process plus what it is doing."""

    def __init__(self, slot: int, env: dict, log_path: Path):
        self.slot = slot
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.gen = 0
        self.ready = False
        self.task: dict | None = None
        self.inflight: dict | None = None
        self.clock = 0.0           # monotonic time the current limit counts from
        self.limit: float | None = None
        self.killing: str | None = None  # "hang" once the watchdog fired
        self.log_offset = 0
        self.started = 0.0
        self.versions: dict = {}

    @property
    def busy(self) -> bool:
        return self.task is not None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        """What this process (not the slot's earlier ones) last wrote. When faulthandler
        dumped a stack (fatal signal, or SIGUSR2 before a hang kill), the excerpt starts at
        the dump, whose first frames are the innermost ones; else it is the last lines."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self.log_offset)
                text = fh.read()[-65536:].decode("utf-8", "replace")
        except OSError:
            return []
        all_lines = text.splitlines()
        for j in range(len(all_lines) - 1, -1, -1):
            ln = all_lines[j]
            if ln.startswith("Current thread") or ln.startswith("Fatal Python error"):
                start = j - 2 if j >= 2 and all_lines[j - 2].startswith("Fatal Python error") else j
                return all_lines[start: start + lines]
        return all_lines[-lines:]


class Pool:
    """``n`` worker slots; ``envs[i]`` is added to the environment of slot ``i``."""

    def __init__(self, envs: list[dict], log_dir: str | os.PathLike, *, case_timeout: float | None = None,
                 python: str | None = None):
        self.events: queue.Queue = queue.Queue()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.case_timeout = case_timeout
        self.python = python or sys.executable
        self.workers = [Worker(i, e, self.log_dir / f"worker-{i}.log") for i, e in enumerate(envs)]
        self.restarts = 0
        self._closed = False
        #: how the workers were started (forked from the zygote, or fresh processes and why)
        self.launcher: str | None = None

    # -- processes -----------------------------------------------------------------------
    def start(self) -> None:
        for w in self.workers:
            self._spawn(w)

    def _spawn(self, w: Worker) -> None:
        w.gen += 1
        w.ready = False
        w.task = None
        w.inflight = None
        w.killing = None
        w.limit = STARTUP_TIMEOUT_S
        w.clock = w.started = time.monotonic()
        with open(w.log_path, "ab") as log:
            log.write(f"--- mla-fuzz worker slot {w.slot}, start {w.gen} ---\n".encode())
            log.flush()
            w.log_offset = log.tell()
            rfd, wfd = os.pipe()
            env = dict(os.environ)
            env.update(w.env)
            env["PYTHONUNBUFFERED"] = "1"
            env["MLA_FUZZ_OWNER_PID"] = str(os.getpid())
            try:
                w.proc = self._fork(env, log.fileno(), wfd)
                if w.proc is None:
                    w.proc = subprocess.Popen(
                        [self.python, "-m", "mla_fuzz.harness.worker", "--fd", str(wfd)], stdin=subprocess.PIPE,
                        stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(wfd,), start_new_session=True)
            finally:
                os.close(wfd)
        t = threading.Thread(target=self._read, args=(w, w.gen, rfd), daemon=True,
                             name=f"mla-fuzz-worker-{w.slot}")
        t.start()

    def _fork(self, env: dict, log_fd: int, msg_fd: int):
        """The worker forked from this process's zygote (``harness.zygote``), or None to start a
        fresh process: the zygote is off, cannot start, or runs another Python."""
        from . import zygote
        if self.python != sys.executable or not zygote.enabled():
            if self.launcher is None:
                self.launcher = "fresh processes" + ("" if zygote.enabled() else " (MLA_FUZZ_ZYGOTE=0)")
            return None
        z = zygote.for_env(env)
        proc = z.spawn(["--fd", "{fd}"], env, log_fd, msg_fd, STARTUP_TIMEOUT_S) if z is not None else None
        if proc is None:
            why = z.reason if z is not None else "it is off"
            self.launcher = f"fresh processes: the preloaded parent process could not fork them ({why})"
        elif self.launcher is None:
            self.launcher = zygote.describe(z)
        return proc

    def _read(self, w: Worker, gen: int, rfd: int) -> None:
        with os.fdopen(rfd, "rb") as fh:
            for line in fh:
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.events.put(("msg", w.slot, gen, msg))
        self.events.put(("eof", w.slot, gen, None))

    def _kill(self, w: Worker) -> None:
        if w.proc is not None and w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    # -- tasks ---------------------------------------------------------------------------
    def idle(self) -> list[Worker]:
        return [w for w in self.workers if w.ready and not w.busy and w.killing is None]

    def submit(self, w: Worker, task: dict) -> None:
        """Hand ``task`` (a dict with ``op`` and ``id``) to the idle worker ``w``."""
        w.task = task
        w.inflight = None
        w.clock = time.monotonic()
        w.limit = self.case_timeout
        try:
            w.proc.stdin.write((json.dumps(task) + "\n").encode())
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died just now; its end-of-pipe event reports the task as lost

    def request_stop(self) -> None:
        """Ask every busy worker to end its fuzz chunk at the next step (SIGUSR1)."""
        for w in self.workers:
            if w.busy and w.proc is not None and w.proc.poll() is None:
                try:
                    w.proc.send_signal(signal.SIGUSR1)
                except ProcessLookupError:
                    pass

    def kill_busy(self, which) -> None:
        """SIGKILL the workers whose current task satisfies ``which(task)``; each ends as a
        ``died`` event and is restarted like any other dead worker."""
        for w in self.workers:
            if w.busy and which(w.task):
                self._kill(w)

    @property
    def busy(self) -> bool:
        return any(w.busy for w in self.workers)

    @property
    def running(self) -> int:
        """How many workers have a task."""
        return sum(1 for w in self.workers if w.busy)

    # -- events --------------------------------------------------------------------------
    def poll(self, timeout: float = 0.25) -> list[Event]:
        """Events since the last call (waiting up to ``timeout`` for the first one)."""
        out: list[Event] = []
        try:
            item = self.events.get(timeout=timeout)
            while True:
                ev = self._handle(*item)
                if ev is not None:
                    out.append(ev)
                item = self.events.get_nowait()
        except queue.Empty:
            pass
        self._watchdog()
        return out

    def _handle(self, kind: str, slot: int, gen: int, msg: dict | None) -> Event | None:
        w = self.workers[slot]
        if gen != w.gen:
            return None
        if kind == "eof":
            return self._ended(w)
        t = msg.get("t")
        if t == "ready":
            w.ready = True
            w.versions = msg.get("versions") or {}
            w.limit = None
            return Event("ready", slot, None, msg)
        if t == "fatal":
            return Event("fatal", slot, None, msg)
        if t in ("step", "phase"):
            w.inflight = msg
            w.clock = time.monotonic()
            if self.case_timeout is not None:
                w.limit = self.case_timeout * (DIAGNOSE_FACTOR if t == "phase" else 1.0)
            return Event(t, slot, w.task, msg)
        if t == "found":  # a fuzz chunk's first failure, unshrunk; the chunk goes on shrinking it
            return Event(t, slot, w.task, msg)
        if t in ("done", "error"):
            task, w.task, w.inflight, w.limit = w.task, None, None, None
            return Event(t, slot, task, msg)
        return None

    def _ended(self, w: Worker) -> Event | None:
        proc = w.proc
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill(w)
            rc = proc.wait()
        if self._closed:
            return None
        task, inflight, was = w.task, w.inflight, w.killing
        info = {"inflight": inflight, "returncode": rc, "signal": _signal_name(rc), "log_tail": w.log_tail(),
                "seconds": time.monotonic() - w.clock, "versions": w.versions}
        if not w.ready:
            return Event("fatal", w.slot, task, {"error": f"worker exited during start-up ({exit_text(rc)})",
                                                 "log_tail": info["log_tail"]})
        self.restarts += 1
        self._spawn(w)
        if task is None:  # died between tasks: nothing to attribute
            return None
        return Event("hung" if was == "hang" else "died", w.slot, task, info)

    def _watchdog(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.killing is None and w.limit is not None and now - w.clock > w.limit:
                if not w.ready:
                    w.killing = "startup"
                    self._kill(w)
                    continue
                w.killing = "hang"
                try:
                    w.proc.send_signal(signal.SIGUSR2)
                    time.sleep(DUMP_GRACE_S)
                except ProcessLookupError:
                    pass
                self._kill(w)

    # -- shutdown ------------------------------------------------------------------------
    def close(self, kill: bool = False, wait_s: float = 5.0) -> None:
        """Stop every worker: politely (``exit`` task, then SIGKILL after ``wait_s``) or at once."""
        self._closed = True
        for w in self.workers:
            if w.proc is None or w.proc.poll() is not None:
                continue
            if kill or w.busy or not w.ready:
                self._kill(w)
                continue
            try:
                w.proc.stdin.write(b'{"op": "exit"}\n')
                w.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + wait_s
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(w)
                w.proc.wait()
            for stream in (w.proc.stdin,):
                try:
                    stream.close()
                except Exception:
                    pass


def _signal_name(rc: int | None) -> str | None:
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def exit_text(rc: int | None) -> str:
    """``killed by SIGABRT`` / ``exit code 3``: how a worker process ended, for messages."""
    if rc is None:  # a forked worker whose zygote ended before it did
        return "exit status unknown"
    sig = _signal_name(rc)
    return f"killed by {sig}" if sig else f"exit code {rc}"
