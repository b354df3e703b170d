"""A pre-imported process that outlives commands: ``mla-fuzz server start`` (opt-in).

Every ``mla-fuzz`` command that starts workers pays for importing torch, ``torch._dynamo``
and triton before its first finding: seconds on a GPU machine (docs/cli.md, "The server"),
paid once per command by its zygote (``harness.zygote``). A server pays them once per
machine: it imports the zygote's modules (``zygote.PRELOAD`` and ``OWN_PRELOAD``: our harness
and kernels, nothing of a user's backend), never touches CUDA, and listens on a Unix socket
that only its user can reach. A command started while a server runs for its environment
sends it its arguments, environment, working directory, ``sys.path``, start time and its
own stdin, stdout and stderr; the server forks a child that runs the command in place of
the client (``cli.main``), writing straight to the user's terminal, and that child asks the
same server to fork its workers. The client forwards signals (Ctrl-C) to the child and
exits with its status. Each child is a new process that starts from the same state as a
fresh process that has just imported those modules; its clock starts when the client did.

A server serves one import environment (``zygote.import_key`` of the workers' environment,
with the Python and this package's location): a command from another environment, or one
with ``MLA_FUZZ_SERVER=0``, runs as if there were none. A server refuses new commands once a
file it imported has changed since it started (an upgraded torch, an edited zygote) and then
exits; the command runs without it and says so. It exits after ``--idle-minutes`` with no
command, on ``mla-fuzz server stop`` (after the commands it runs end), or on SIGTERM.

Protocol: ``zygote``'s, one JSON record per ``SOCK_SEQPACKET`` message, per connection:
- server -> client on connect: ``{"t": "ready", "preload_s", "pid", "since"}`` or
  ``{"t": "refused", "why"}``;
- client -> server: ``{"id", "run": "command", "argv", "env", "cwd", "sys_path", "started"}``
  with the client's descriptors 0, 1, 2, or a worker request as the zygote's (``run``
  ``worker``, ``cwd``);
- server -> client: ``{"t": "forked", "id", "pid"}``, then ``{"t": "exit", "pid", "rc"}``.
A client that disconnects while its command runs gets the command interrupted (SIGINT).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from . import zygote
from .procs import pid_alive

#: default idle time before a server exits (minutes)
IDLE_MINUTES = 30.0
_PKG = Path(__file__).resolve().parent.parent  # mla_fuzz's folders: harness/ sits in it
_SERVER_PY = "mla_fuzz.harness.server"


def enabled() -> bool:
    """Whether commands may run in a server (``MLA_FUZZ_SERVER`` not ``0``; Linux)."""
    return os.environ.get("MLA_FUZZ_SERVER", "1") != "0" and zygote.enabled()


def server_dir() -> Path:
    """Where servers keep their sockets: ``MLA_FUZZ_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/mla-fuzz``,
    else ``/tmp/mla-fuzz-<uid>``; created private (0700)."""
    d = os.environ.get("MLA_FUZZ_SERVER_DIR")
    if not d:
        run = os.environ.get("XDG_RUNTIME_DIR")
        d = os.path.join(run, "mla-fuzz") if run and os.path.isdir(run) else f"/tmp/mla-fuzz-{os.getuid()}"
    path = Path(d)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not private to this user (owner {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return path


def key_for(env: dict) -> str:
    """The name of the server that serves workers with environment ``env``: the Python, this
    package's location and what the imports read (``zygote.import_key``)."""
    blob = json.dumps([sys.executable, str(_PKG), list(zygote.import_key(env))])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def paths(key: str) -> tuple[Path, Path, Path]:
    """(socket, record, log) of server ``key``."""
    d = server_dir()
    return d / f"{key}.sock", d / f"{key}.json", d / f"{key}.log"


@contextlib.contextmanager
def _short(path: Path):
    """``path`` spelled through a descriptor of its folder (``/proc/self/fd/N/NAME``): a Unix
    socket's address is limited to 107 bytes, and a server folder deep in a home or a test's
    temporary tree would exceed it."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _connect(key: str) -> tuple[socket.socket, dict] | None:
    """A connection to server ``key`` and its greeting, or None when none listens there."""
    try:
        sock_path = paths(key)[0]
    except OSError:
        return None
    if not sock_path.exists():
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(10.0)
        with _short(sock_path) as addr:
            s.connect(addr)
        data = s.recv(zygote._RECORD)
        s.settimeout(None)
    except OSError:
        s.close()
        return None
    if not data:
        s.close()
        return None
    return s, json.loads(data)


# -- the client: a command started while a server runs ------------------------------------
def run_command(argv: list[str], worker_env: dict, started: float) -> int | None:
    """Run ``mla-fuzz argv`` in the server for ``worker_env`` and return its exit status, or
    None when no server can take it (nothing ran: run the command here)."""
    if not enabled():
        return None
    got = _connect(key_for(worker_env))
    if got is None:
        return None
    sock, hello = got
    with sock:
        if hello.get("t") != "ready":
            print(f"mla-fuzz: note: not using the mla-fuzz server: {hello.get('why')}", file=sys.stderr)
            return None
        req = {"id": 1, "run": "command", "argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(),
               "sys_path": list(sys.path), "started": started}
        try:
            socket.send_fds(sock, [json.dumps(req).encode()], [0, 1, 2])
        except OSError:
            return None
        pid = None
        forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

        def forward(signum, frame):
            if pid is not None:
                try:
                    os.kill(pid, signum)
                except OSError:
                    pass
        old = {s: signal.signal(s, forward) for s in forwarded}
        try:
            while True:
                try:
                    data = sock.recv(zygote._RECORD)
                except InterruptedError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    if pid is None:
                        return None  # the server went before it forked: nothing ran
                    # the command lives on (it is not the server's to end): stay attached, as the
                    # user's terminal and Ctrl-C are, until it ends; only its status is lost
                    while pid_alive(pid):
                        time.sleep(0.2)
                    print(f"mla-fuzz: the mla-fuzz server ended while it ran this command (pid {pid}); the "
                          "command has ended, its exit status is unknown (its report and repros are where it "
                          "was told to write them)", file=sys.stderr)
                    return 3
                msg = json.loads(data)
                if msg.get("t") == "forked":
                    pid = msg["pid"]
                elif msg.get("t") == "exit" and msg.get("pid") == pid:
                    rc = msg["rc"]
                    return rc if rc >= 0 else 128 - rc
        finally:
            for s, h in old.items():
                signal.signal(s, h)


# -- the server ---------------------------------------------------------------------------
def _fingerprint() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every imported file a child would run stale code from: this package's
    modules the server imported and the preloaded libraries' top files."""
    out = {}
    names = [m for m in sys.modules if m == "mla_fuzz" or m.startswith("mla_fuzz.")]
    names += [m for m in zygote.PRELOAD if "." not in m]
    for name in names:
        f = getattr(sys.modules.get(name), "__file__", None)
        if f:
            try:
                st = os.stat(f)
            except OSError:
                continue
            out[f] = (st.st_mtime_ns, st.st_size)
    return out


def _changed(before: dict) -> str | None:
    for f, sig in before.items():
        try:
            st = os.stat(f)
            now = (st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        if now != sig:
            return f
    return None


def _command_child(req: dict, fds: list[int], keep: list[int]) -> None:
    """In a forked child: run ``mla-fuzz req["argv"]`` as the client would have; never returns."""
    def setup() -> None:
        zygote.detach(keep, req["env"], "mla-fuzz")
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.chdir(req["cwd"])
        sys.path[:] = req["sys_path"]
        sys.argv = ["mla-fuzz", *req["argv"]]
        # Python chose buffering from what the server's descriptors were: choose again for the user's
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1 if unbuffered or os.isatty(1) else -1,
                                           closefd=False, errors="backslashreplace")
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")

    def body() -> int:
        from . import cli
        try:
            code = cli.main(req["argv"], started=req["started"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        import atexit
        atexit._run_exitfuncs()  # what interpreter exit would run: the zygotes' and pools' ends
        return code
    zygote.become(body, setup=setup)


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.commands: set[int] = set()   # children that run a command for this client
        self.children: set[int] = set()

    def send(self, msg: dict) -> None:
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError:
            pass


def serve(sock_path: str, record_path: str, idle_s: float) -> int:
    """The server's loop: preload, listen on ``sock_path``, fork per request; returns on idle,
    SIGTERM, or a changed file once no client is connected."""
    seconds = zygote._preload()
    path0 = sys.path[0]
    prints = _fingerprint()
    since = time.time()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{sock_path}.{os.getpid()}"
    with _short(Path(tmp)) as addr:
        listener.bind(addr)
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.replace(tmp, sock_path)
    record = {"pid": os.getpid(), "since": since, "preload_s": round(seconds, 3), "python": sys.executable,
              "package": str(_PKG), "idle_s": idle_s, "socket": sock_path,
              "graph": os.environ.get("MLA_FUZZ_SERVER_GRAPH", "auto")}
    Path(record_path).write_text(json.dumps(record))
    stopping = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    conns: dict[int, _Conn] = {}
    owner: dict[int, _Conn] = {}
    last = time.monotonic()

    def stop_listening() -> None:
        nonlocal listener
        if listener is not None:
            try:  # a newer server may have taken the name since: leave its files alone
                cur = json.loads(Path(record_path).read_text())
                if cur.get("pid") == os.getpid():
                    os.unlink(sock_path)
                    os.unlink(record_path)
            except (OSError, ValueError):
                pass
            listener.close()
            listener = None

    while True:
        if stopping:
            stop_listening()
        busy = conns or owner
        if listener is None and not busy:
            return 0
        timeout = None if busy else max(0.0, idle_s - (time.monotonic() - last))
        if not busy and timeout == 0.0:
            stop_listening()
            return 0
        watch = [wake_r, *(c.sock for c in conns.values())] + ([listener] if listener is not None else [])
        try:
            ready, _, _ = select.select(watch, [], [], timeout)
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid, rc in (zygote.reap() if owner else ()):
            c = owner.pop(pid, None)
            if c is not None:
                c.children.discard(pid)
                c.commands.discard(pid)
                c.send({"t": "exit", "pid": pid, "rc": rc})
            last = time.monotonic()
        if listener is not None and listener in ready:
            try:
                s, _ = listener.accept()
            except OSError:
                s = None
            if s is not None:
                last = time.monotonic()
                stale = _changed(prints)
                if stale is not None:
                    c = _Conn(s)
                    c.send({"t": "refused", "why": f"{stale} changed after the server (pid {os.getpid()}) started; "
                                                  "it stops now (`mla-fuzz server start` starts a new one)"})
                    s.close()
                    stopping.append("stale")
                else:
                    conns[s.fileno()] = c = _Conn(s)
                    c.send({"t": "ready", "preload_s": round(seconds, 3), "pid": os.getpid(), "since": since})
        for c in list(conns.values()):
            if c.sock not in ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(c.sock, zygote._RECORD, 3)
            except InterruptedError:
                continue
            except OSError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                del conns[c.sock.fileno()]
                for pid in c.commands:  # its client is gone: no one reads the command's status
                    try:
                        os.kill(pid, signal.SIGINT)
                    except OSError:
                        pass
                c.sock.close()
                last = time.monotonic()
                continue
            req = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            keep = [wake_r, wake_w, *(x.sock.fileno() for x in conns.values())]
            if listener is not None:
                keep.append(listener.fileno())
            pid = os.fork()
            if pid == 0:
                if req.get("run") == "command":
                    _command_child(req, list(fds), keep)
                if req.get("cwd"):
                    os.chdir(req["cwd"])
                    if sys.path and sys.path[0] == path0:
                        sys.path[0] = req["cwd"]  # as ``python -m`` in the command's folder
                zygote._child(req, list(fds), keep)
            for fd in fds:
                os.close(fd)
            owner[pid] = c
            c.children.add(pid)
            if req.get("run") == "command":
                c.commands.add(pid)
            c.send({"t": "forked", "id": req["id"], "pid": pid})


# -- start, stop, status ------------------------------------------------------------------
def read_record(key: str) -> dict | None:
    """Server ``key``'s record while its process lives, else None."""
    try:
        rec = json.loads(paths(key)[1].read_text())
    except (OSError, ValueError):
        return None
    return rec if pid_alive(int(rec.get("pid", 0))) else None


def start(worker_env: dict, graph: str, idle_minutes: float, timeout: float = 600.0,
          progress=None) -> tuple[dict, bool]:
    """Start the server for ``worker_env`` unless one runs; returns (its record, started now).
    Raises RuntimeError with the reason when it cannot start."""
    import subprocess
    key = key_for(worker_env)
    rec = read_record(key)
    if rec is not None:
        return rec, False
    sock_path, record_path, log_path = paths(key)
    for p in (sock_path, record_path):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    env = dict(worker_env)
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # as the zygote: ask NVML, never initialise CUDA
    env["MLA_FUZZ_SERVER_GRAPH"] = graph
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", _SERVER_PY, "--socket", str(sock_path), "--record",
                                 str(record_path), "--idle-s", str(idle_minutes * 60.0)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=os.getcwd())
    t0 = time.monotonic()
    while True:
        rec = read_record(key)
        if rec is not None and rec.get("pid") == proc.pid:
            return rec, True
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready"
                               + (f": {tail[0]}" if tail else "") + f" (log: {log_path})")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"the server was not ready within {timeout:g} s (log: {log_path})")
        if progress is not None:
            progress(time.monotonic() - t0)
        time.sleep(0.1)


def records() -> list[dict]:
    """Every live server's record (with its ``key``)."""
    try:
        d = server_dir()
    except OSError:
        return []
    out = []
    for p in sorted(d.glob("*.json")):
        rec = read_record(p.stem)
        if rec is not None:
            out.append({**rec, "key": p.stem})
    return out


def stop(rec: dict, timeout: float = 10.0) -> bool:
    """Ask the server of ``rec`` to stop (SIGTERM: it stops listening at once and exits once
    its commands end); True when it has exited within ``timeout``."""
    pid = int(rec["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog=f"python -m {_SERVER_PY}")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--record", required=True)
    ap.add_argument("--idle-s", type=float, default=IDLE_MINUTES * 60.0)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = serve(args.socket, args.record, args.idle_s)
    except Exception as exc:  # noqa: BLE001 - `server start` reports the log's last line
        import traceback
        traceback.print_exc()
        print(f"mla-fuzz server: {type(exc).__name__}: {exc}", flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: it would only walk the frozen imports


if __name__ == "__main__":
    sys.exit(_main())
