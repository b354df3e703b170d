"""A private CUDA MPS daemon for the workers of one campaign (``--mps``).

Several worker processes on one GPU without MPS time-slice it: each process has its own
context and the GPU switches between them, so a fuzzer whose steps are many tiny kernels
and host syncs stops scaling at about two processes (measured on an H200, tiny spec: 1
worker 10 cases/s, 8 workers 22). Under MPS their kernels share the GPU concurrently (same
machine: 8 workers 80 cases/s, 12 workers 99).

The daemon gets its own pipe and log directories (``CUDA_MPS_PIPE_DIRECTORY`` /
``CUDA_MPS_LOG_DIRECTORY`` in a temporary directory), so only this campaign's workers —
which get those variables in their environment — connect to it; other CUDA programs on
the machine are untouched. It is stopped (``quit``) and its directory removed at the end.

With several GPUs, ``MpsDaemons`` starts one daemon per GPU, pinned to it with
``CUDA_VISIBLE_DEVICES`` (the per-GPU layout of NVIDIA's MPS guide); a worker connects to
its GPU's daemon, so a fatal fault stays among the workers of one GPU. (It did not change
the multi-GPU scaling at 8 workers per GPU, 0.67 shared vs 0.71 per GPU: that is bound by
the host's CPUs, see docs/cli.md.)
A daemon started with ``CUDA_VISIBLE_DEVICES`` renumbers the GPUs its clients see (its GPU
is their device 0: NVIDIA's MPS guide, "CUDA_VISIBLE_DEVICES"), so a worker's own
``CUDA_VISIBLE_DEVICES`` is replaced by ``0`` when it is handed to the daemon.

Caveat, handled by the campaign: MPS shares a fatal GPU fault among the processes on that
GPU, so one worker's illegal memory access also ends its neighbours. See
``harness.campaign`` (crash repros found under MPS are confirmed by a replay without MPS).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from .procs import pid_alive

CONTROL = "nvidia-cuda-mps-control"
#: points at the control binary when it is not on PATH (also used by the tests' fake)
CONTROL_ENV = "MLA_FUZZ_MPS_CONTROL"


class MpsError(ValueError):
    """MPS could not be used: a user-facing message (the binary is missing, or the daemon
    did not start)."""


def find_control() -> str | None:
    """Path of ``nvidia-cuda-mps-control`` (``$MLA_FUZZ_MPS_CONTROL``, then PATH, then the
    usual driver directories), or None."""
    forced = os.environ.get(CONTROL_ENV)
    if forced:
        return forced if os.access(forced, os.X_OK) else None
    found = shutil.which(CONTROL)
    if found:
        return found
    for d in ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin"):
        p = os.path.join(d, CONTROL)
        if os.access(p, os.X_OK):
            return p
    return None


class MpsDaemon:
    """Start with ``start()`` (or ``with``), hand ``env()`` to the workers, ``stop()`` at the end."""

    def __init__(self, control: str | None = None, timeout_s: float = 30.0, device: str | None = None):
        """``device``: a ``CUDA_VISIBLE_DEVICES`` value for the daemon (its server then sees
        only that GPU, as its clients' device 0); None: every GPU, numbered as usual."""
        self.device = device
        self.control = control or find_control()
        if self.control is None:
            raise MpsError(f"--mps: {CONTROL} was not found (PATH, /usr/local/nvidia/bin, /usr/bin); "
                           f"install the NVIDIA driver utilities or set {CONTROL_ENV}")
        self.timeout_s = timeout_s
        self._dir: str | None = None

    def env(self) -> dict:
        """The variables a worker needs to connect to this daemon (empty before ``start``)."""
        if self._dir is None:
            return {}
        return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self._dir, "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(self._dir, "log")}

    def client_env(self, worker_env: dict) -> dict:
        """``worker_env`` (a worker's environment additions) connected to this daemon; a
        pinned daemon's GPU is the client's device 0 (module doc)."""
        env = dict(worker_env, **self.env())
        if self.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = "0"
        return env

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env()}
        if self.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.device
        return subprocess.run([self.control, *args], input=stdin, env=env,
                              capture_output=True, text=True, timeout=self.timeout_s)

    def start(self) -> "MpsDaemon":
        self._dir = tempfile.mkdtemp(prefix="mla-fuzz-mps-")
        for sub in ("pipe", "log"):
            os.makedirs(os.path.join(self._dir, sub))
        try:
            res = self._run(["-d"])
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._cleanup()
            raise MpsError(f"--mps: could not start {self.control} -d: {exc}") from None
        if res.returncode != 0:
            self._cleanup()
            raise MpsError(f"--mps: {self.control} -d exited {res.returncode}: "
                           f"{(res.stderr or res.stdout).strip()[:300]}")
        return self

    def stop(self) -> None:
        """Ask the daemon to quit (it stops its server after the clients are gone) and
        remove its directory; never raises."""
        if self._dir is None:
            return
        try:
            # quit is asynchronous: wait for the server processes themselves (their pids
            # from get_server_list), so a daemon started next does not find this one's
            # server still holding the GPU; the pipe files are not a signal (an H200 host
            # kept them for more than 30 s after quit)
            listing = self._run([], stdin="get_server_list\n").stdout or ""
            pids = [int(t) for t in listing.split() if t.isdigit()]
            self._run([], stdin="quit\n")
            deadline = time.monotonic() + self.timeout_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if pid_alive(p)]
                if pids:
                    time.sleep(0.05)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._cleanup()

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "MpsDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MpsDaemons:
    """One ``MpsDaemon`` per GPU of the workers (module doc); ``start()``, hand each worker
    ``client_env(its env)``, ``stop()`` at the end (or ``with``)."""

    def __init__(self, devices: list[str], control: str | None = None, timeout_s: float = 30.0):
        """``devices``: the workers' ``CUDA_VISIBLE_DEVICES`` values, one daemon per distinct one."""
        self.daemons = {d: MpsDaemon(control, timeout_s, device=d or None) for d in dict.fromkeys(devices)}

    @classmethod
    def for_envs(cls, envs: list[dict], control: str | None = None) -> "MpsDaemons":
        """Daemons for these worker environments (each pinned by ``CUDA_VISIBLE_DEVICES``)."""
        return cls([e.get("CUDA_VISIBLE_DEVICES", "") for e in envs], control)

    def start(self) -> "MpsDaemons":
        started = []
        try:
            for d in self.daemons.values():
                started.append(d.start())
        except BaseException:
            for d in started:
                d.stop()
            raise
        return self

    def client_env(self, worker_env: dict) -> dict:
        """``worker_env`` connected to the daemon of its GPU; a worker without a pinned GPU
        (``CUDA_VISIBLE_DEVICES`` unset or empty) goes to an unpinned daemon."""
        dev = worker_env.get("CUDA_VISIBLE_DEVICES", "")
        if dev not in self.daemons:
            raise KeyError(f"no MPS daemon for CUDA_VISIBLE_DEVICES={dev!r} (have {sorted(self.daemons)})")
        return self.daemons[dev].client_env(worker_env)

    def stop(self) -> None:
        """Stop every daemon (never raises)."""
        for d in self.daemons.values():
            d.stop()

    def __enter__(self) -> "MpsDaemons":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
