"""One process that imports the heavy modules once and forks every worker from them.

A fresh worker process pays for its imports before its first example: torch, then
``torch._dynamo``, which the first call of an op registered with ``torch.library.custom_op``
imports (our kernels and most engines' backends are such ops). With many workers those
seconds are paid once each, side by side, before every row's first finding (figures:
docs/cli.md, "Workers and crash isolation"). The zygote (``python -m mla_fuzz.harness.zygote``,
started by the command as its first act, so its imports overlap the command's own) imports
torch, ``torch._dynamo``, triton, numpy and hypothesis once -- never touching CUDA -- and
then forks each worker on request: a child starts with those modules loaded, sets its own
environment (``CUDA_VISIBLE_DEVICES`` before its first CUDA call) and runs
``harness.worker``. Forking before CUDA is initialised is what PyTorch's own DataLoader does.

Of mla-fuzz's own modules it imports the harness and our kernels (``OWN_PRELOAD``); nothing
of a user's backend is imported here: the worker loads it, so a backend's import-time effects
stay in the worker. ``MLA_FUZZ_ZYGOTE=0`` starts workers as fresh
processes instead; so does a zygote that cannot start (``Zygote.reason`` says why, and the
pool reports it).

Protocol on a ``SOCK_SEQPACKET`` socket pair (``--fd N``), one JSON record per message:
- parent -> zygote: ``{"env": {...}, "argv": [...], "id": n}`` with three file descriptors
  (the worker's stdin, its log for stdout and stderr, its message pipe's write end);
- zygote -> parent: ``{"t": "ready", "preload_s"}`` once, or ``{"t": "fatal", "error"}``;
  ``{"t": "forked", "id", "pid"}`` per request; ``{"t": "exit", "pid", "rc"}`` when a child
  ends (``rc`` as ``subprocess``: negative for a signal).
The zygote exits when the parent's end closes.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

from .procs import pid_alive

#: what every worker imports before its first example (the order matters only for timing)
PRELOAD = ("torch", "torch._dynamo", "triton", "numpy", "hypothesis")
#: mla-fuzz's own modules, imported next: the harness every worker runs, and the Triton kernels
#: that our backend, the mutants and the examples launch (their ``triton.jit`` decorators read
#: and parse every kernel's source). A failure here is left for the worker to meet and report
OWN_PRELOAD = ("mla_fuzz.harness.fuzz", "mla_fuzz.kernels", "mla_fuzz.harness.mutants")
_WHAT = ", ".join(PRELOAD) + " and mla-fuzz's harness and kernels"  # for reports
_RECORD = 1 << 20  # one request: its environment travels whole


def _preload() -> float:
    t0 = time.monotonic()
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            if name == "torch":
                raise
    for name in OWN_PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker's own import of it reports the error
            pass
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # a fork would inherit a CUDA context no child can use
        raise RuntimeError("CUDA was initialised while importing " + ", ".join(PRELOAD + OWN_PRELOAD))
    # The imports leave objects that live as long as the process. Every full collection in a
    # child would walk them again (and write to their pages, which a fork then copies); frozen,
    # collections skip them (figures: docs/cli.md, "Workers and crash isolation").
    import gc
    gc.freeze()
    return time.monotonic() - t0


def become(body, *, setup) -> None:
    """In a process just forked from a preloaded one: ``setup()``, then ``body()`` (its exit
    status), then leave with that status; never returns. A traceback for anything raised,
    stdio flushed, and ``os._exit``: the parent's exit handlers are not the child's to run."""
    code = 3
    try:
        setup()
        code = body()
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 3)


def detach(keep: list[int], env: dict, name: str) -> None:
    """A forked child's first steps: its own session, the parent's signal plumbing undone and
    descriptors ``keep`` closed, environment ``env`` in place of the parent's, and process
    name ``name`` (``ps -o comm``, ``top``: the command line shown is the parent's)."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keep:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(name)
    except OSError:
        pass


def _child(req: dict, fds: list[int], keep: list[int]) -> None:
    """In the forked child: become the worker ``req`` describes; never returns."""
    stdin_fd, log_fd, msg_fd = fds

    def setup() -> None:
        detach(keep, req["env"], "mla-fuzz-worker")
        os.dup2(stdin_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(stdin_fd)
        os.close(log_fd)

    def body() -> int:
        from mla_fuzz.harness import worker
        return worker.main([a.replace("{fd}", str(msg_fd)) for a in req["argv"]])
    become(body, setup=setup)


def reap() -> list[tuple[int, int]]:
    """``(pid, rc)`` of every child of this process that has ended, without waiting (``rc`` as
    ``subprocess``: negative for a signal)."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        out.append((pid, _status(status)))
    return out


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(sock: socket.socket) -> int:
    """The zygote's loop: preload, then fork a worker per request and report each child's end."""
    def send(msg: dict) -> None:
        try:
            sock.send(json.dumps(msg).encode())
        except OSError:
            os._exit(0)  # the parent is gone

    try:
        seconds = _preload()
    except BaseException as exc:
        send({"t": "fatal", "error": f"{type(exc).__name__}: {exc}"})
        return 3
    send({"t": "ready", "preload_s": round(seconds, 3)})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import select
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid, rc in (reap() if children else ()):
            children.discard(pid)
            send({"t": "exit", "pid": pid, "rc": rc})
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _RECORD, 3)
        except InterruptedError:
            continue
        if not data:
            return 0  # the parent closed its end
        req = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, list(fds), [sock.fileno(), wake_r, wake_w])
        for fd in fds:
            os.close(fd)
        children.add(pid)
        send({"t": "forked", "id": req["id"], "pid": pid})


class ForkedProcess:
    """A worker forked by the zygote, with the part of ``subprocess.Popen``'s interface the pool
    uses (``pid``, ``stdin``, ``poll``, ``wait``, ``send_signal``, ``returncode``). Its exit
    status comes from the zygote; if the zygote itself is gone, from the process's absence
    (``returncode`` None: unknown)."""

    def __init__(self, zygote: "Zygote", pid: int, stdin):
        self._zygote = zygote
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self.ended = threading.Event()

    def poll(self) -> int | None:
        if not self.ended.is_set() and self._zygote.dead and not pid_alive(self.pid):
            self.ended.set()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        import subprocess
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended.is_set():
            self.poll()
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired("mla-fuzz worker", timeout)
            self.ended.wait(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if not self.ended.is_set():
            os.kill(self.pid, sig)


class Zygote:
    """The parent's handle on one zygote process. ``spawn`` never blocks on the zygote's
    imports: requests wait in the socket until it is ready."""

    def __init__(self, env: dict, python: str | None = None, log_path: str | None = None, origin: str = "pool"):
        import subprocess
        self._state(origin)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(env)
        env["PYTHONUNBUFFERED"] = "1"
        # should an import ask whether CUDA is available, NVML answers, without initialising
        # the driver in a process that forks (the workers get their own environment back)
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        log = open(log_path or os.devnull, "ab")
        try:
            self.proc = subprocess.Popen([python or sys.executable, "-m", "mla_fuzz.harness.zygote", "--fd",
                                          str(theirs.fileno())], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, pass_fds=(theirs.fileno(),),
                                         start_new_session=True)
        finally:
            theirs.close()
            log.close()
        threading.Thread(target=self._read, daemon=True, name="mla-fuzz-zygote").start()

    @classmethod
    def attach(cls, sock: socket.socket, hello: dict) -> "Zygote":
        """A handle on a running server (``harness.server``) that greeted ``sock`` with
        ``hello``: it forks workers as a zygote does and outlives this process."""
        self = cls.__new__(cls)
        self._state("server")
        self.preload_s = hello.get("preload_s")
        self.server_pid = hello.get("pid")
        self.ready.set()
        self._sock = sock
        self.proc = None
        threading.Thread(target=self._read, daemon=True, name="mla-fuzz-server").start()
        return self

    def _state(self, origin: str) -> None:
        #: who started it: ``command`` (``prestart``, as the command began), ``pool``, or
        #: ``server`` (a running ``mla-fuzz server``, attached to)
        self.origin = origin
        self.dead = False
        self.reason: str | None = None   # why it cannot be used, once known
        self.preload_s: float | None = None
        self.server_pid: int | None = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, list] = {}      # request id -> [event, pid]
        self._procs: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}         # pid -> rc of an exit seen before its handle

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_RECORD)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            t = msg.get("t")
            if t == "ready":
                self.preload_s = msg.get("preload_s")
                self.ready.set()
            elif t == "fatal":
                self.reason = f"its imports failed: {msg.get('error')}"
                break
            elif t == "forked":
                with self._lock:
                    slot = self._waiting.pop(msg["id"], None)
                if slot is not None:
                    slot[1] = msg["pid"]
                    slot[0].set()
            elif t == "exit":
                with self._lock:
                    proc = self._procs.pop(msg["pid"], None)
                    if proc is None:
                        self._early[msg["pid"]] = msg["rc"]
                if proc is not None:
                    proc.returncode = msg["rc"]
                    proc.ended.set()
        with self._lock:
            self.dead = True
            if self.reason is None:
                self.reason = f"it ended ({self.proc.poll()})" if self.proc is not None else "the server ended"
            waiting = list(self._waiting.values())
            self._waiting.clear()
        for slot in waiting:
            slot[0].set()
        self.ready.set()

    def spawn(self, argv: list[str], env: dict, log_fd: int, msg_fd: int, timeout: float) -> ForkedProcess | None:
        """Fork a worker running ``harness.worker.main(argv)`` (``{fd}`` in ``argv`` becomes
        its message descriptor ``msg_fd``, ``log_fd`` its stdout and stderr) with ``env`` as its
        whole environment, and a new pipe as its stdin (``.stdin`` of the result); None if the
        zygote cannot (``reason`` says why). The caller keeps and closes its descriptors."""
        with self._lock:
            if self.dead:
                return None
            self._next += 1
            rid = self._next
            slot = [threading.Event(), None]
            self._waiting[rid] = slot
        stdin_r, stdin_w = os.pipe()
        try:
            req = {"id": rid, "argv": argv, "env": env, "run": "worker", "cwd": os.getcwd()}
            socket.send_fds(self._sock, [json.dumps(req).encode()],
                            [stdin_r, log_fd, msg_fd])
        except OSError as exc:
            os.close(stdin_w)
            with self._lock:
                self._waiting.pop(rid, None)
                self.reason = self.reason or f"it cannot be reached ({exc})"
            return None
        finally:
            os.close(stdin_r)
        if not slot[0].wait(timeout) or slot[1] is None:
            os.close(stdin_w)
            with self._lock:
                self._waiting.pop(rid, None)
                self.reason = self.reason or f"no worker forked within {timeout:g} s"
            return None
        pid = slot[1]
        proc = ForkedProcess(self, pid, os.fdopen(stdin_w, "wb"))
        with self._lock:
            rc = self._early.pop(pid, None)
            if rc is None:
                self._procs[pid] = proc
        if rc is not None:
            proc.returncode = rc
            proc.ended.set()
        return proc

    def close(self) -> None:
        """End the zygote (its workers are the pools' to stop; they outlive it)."""
        try:
            self._sock.close()
        except OSError:
            pass
        if self.proc is not None and self.proc.poll() is None:  # it holds nothing to flush
            self.proc.kill()
            self.proc.wait()


#: environment variables the preloaded modules read while importing: a worker is forked only
#: from a zygote whose own values of these match the worker's (others start their own zygote)
IMPORT_ENV_PREFIXES = ("TORCH", "PYTORCH", "TRITON", "CUDA", "NVIDIA", "LD_", "PYTHON", "OMP_", "MKL_",
                       "KMP_", "GOMP", "OPENBLAS", "NUMPY", "HYPOTHESIS")
#: ... except these, which are read later (CUDA's at the first CUDA call, thread counts set by
#: the worker itself): workers of one pool differ in them. ``TORCHINDUCTOR_CACHE_DIR`` is
#: set by ``torch._dynamo``'s own import when missing, so a process that imported it would
#: otherwise never match a zygote started before
LATE_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                      "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR"})
#: zygotes kept per process (one per distinct import environment); the oldest goes first
MAX_ZYGOTES = 2
_ZYGOTES: dict[tuple, Zygote] = {}


def import_key(env: dict) -> tuple:
    """The part of ``env`` that the zygote's imports depend on."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(IMPORT_ENV_PREFIXES) and k not in LATE_ENV))


def enabled() -> bool:
    """Whether workers are forked from a zygote (``MLA_FUZZ_ZYGOTE`` not ``0``; Linux)."""
    return os.environ.get("MLA_FUZZ_ZYGOTE", "1") != "0" and hasattr(socket, "send_fds") and sys.platform == "linux"


def for_env(env: dict, python: str | None = None, origin: str = "pool") -> Zygote | None:
    """This process's zygote for workers with environment ``env``, started on first use (None
    when disabled). One serves every pool of the process whose workers import alike; a zygote
    that failed stays failed (``reason``), so its pools start fresh processes and say why."""
    if not enabled():
        return None
    key = import_key(env)
    z = _ZYGOTES.get(key)
    if z is None:
        if len(_ZYGOTES) >= MAX_ZYGOTES:
            _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
        if not _ZYGOTES:
            import atexit
            atexit.register(close_all)
        z = _ZYGOTES[key] = _from_server(env) or Zygote(env, python, origin=origin)
    return z


def _from_server(env: dict) -> Zygote | None:
    """A handle on the running server (``harness.server``) for workers with ``env``, if any."""
    from . import server
    if not server.enabled():
        return None
    got = server._connect(server.key_for(env))
    if got is None:
        return None
    sock, hello = got
    if hello.get("t") != "ready":
        sock.close()
        return None
    return Zygote.attach(sock, hello)


def close_all() -> None:
    """End every zygote of this process."""
    while _ZYGOTES:
        _ZYGOTES.pop(next(iter(_ZYGOTES))).close()


def prestart(env: dict) -> None:
    """Start the zygote for workers with environment ``env`` now, so that its imports overlap
    the caller's (a command calls this before it imports torch itself)."""
    try:
        for_env(env, origin="command")
    except OSError:
        pass  # the pool will start workers itself and say why


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m mla_fuzz.harness.zygote")
    ap.add_argument("--fd", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    code = serve(sock)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: it would only walk the frozen imports


def describe(z: Zygote) -> str:
    """How a pool's workers started, for reports: ``forked from one process that imported ...``."""
    took = "" if z.preload_s is None else f" in {z.preload_s:.1f}s"
    if z.origin == "server":
        return (f"forked from the mla-fuzz server (pid {z.server_pid}; `mla-fuzz server stop` ends it) "
                f"that imported {_WHAT} once{took} when it started")
    when = "as the command started" if z.origin == "command" else "by the pool"
    return f"forked from one process (started {when}) that imported {_WHAT} once{took}"



if __name__ == "__main__":
    sys.exit(_main())
