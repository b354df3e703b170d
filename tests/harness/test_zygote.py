"""Workers forked from one preloaded process (``harness.zygote``): they start, die and restart
as fresh processes did, only a zygote whose imports match the workers' serves them, and a
zygote that cannot start makes the pool start fresh processes and say why."""
from __future__ import annotations

import json
import os
import subprocess
import signal
import sys
import time

import pytest

from mla_fuzz.harness import zygote
from mla_fuzz.harness.worker_env import worker_envs
from mla_fuzz.harness.pool import Pool

def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _until(pool: Pool, pred, timeout: float = 120.0) -> list:
    seen = []
    deadline = time.monotonic() + timeout
    while not pred(seen):
        assert time.monotonic() < deadline, f"timed out; events so far: {[(e.kind, e.msg) for e in seen]}"
        seen += pool.poll(0.2)
    return seen


def _ready(n: int):
    return lambda seen: sum(e.kind == "ready" for e in seen) >= n or any(e.kind == "fatal" for e in seen)


def test_import_key_keeps_what_the_imports_read_and_drops_what_workers_set_later():
    base = {"PATH": "/bin", "HOME": "/root", "PYTEST_CURRENT_TEST": "a", "TRITON_CACHE_DIR": "/c"}
    one = {**base, "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1", "MLA_FUZZ_TORCH_THREADS": "1"}
    other = {**base, "CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "4", "PYTEST_CURRENT_TEST": "b"}
    assert zygote.import_key(one) == zygote.import_key(other) == (("TRITON_CACHE_DIR", "/c"),)
    # Triton decorates its own library's kernels when imported: interpreted or not is fixed then
    assert zygote.import_key({**one, "TRITON_INTERPRET": "1"}) != zygote.import_key(one)
    assert zygote.import_key({**one, "PYTHONPATH": "/x"}) != zygote.import_key(one)
    # set by torch._dynamo's own import: a process that imported it still matches its zygote
    assert zygote.import_key({**one, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"}) == zygote.import_key(one)


@pytest.mark.skipif(not zygote.enabled(), reason="MLA_FUZZ_ZYGOTE=0")
def test_pool_workers_are_forked_by_the_zygote_and_restarted_after_a_kill(tmp_path):
    pool = Pool(worker_envs(2, "emulated", device_count=0, cpu_count=2), tmp_path)
    pool.start()
    try:
        seen = _until(pool, _ready(2))
        assert [e.kind for e in seen].count("ready") == 2, [(e.kind, e.msg) for e in seen]
        assert pool.launcher.startswith("forked from one process"), pool.launcher
        zygote_pids = {z.proc.pid for z in zygote._ZYGOTES.values()}
        pids = [w.proc.pid for w in pool.workers]
        assert all(_ppid(p) in zygote_pids for p in pids), (pids, zygote_pids)
        os.kill(pids[0], signal.SIGKILL)
        _until(pool, lambda seen: pool.restarts == 1 and pool.workers[0].ready)
        assert pool.workers[0].proc.pid not in pids and _ppid(pool.workers[0].proc.pid) in zygote_pids
        assert pool.workers[1].proc.pid == pids[1] and pool.workers[1].ready
    finally:
        pool.close(kill=True)
    assert all(w.proc.poll() is not None for w in pool.workers)


def test_with_the_zygote_off_workers_are_fresh_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_FUZZ_ZYGOTE", "0")
    pool = Pool(worker_envs(1, "emulated", device_count=0, cpu_count=2), tmp_path)
    pool.start()
    try:
        _until(pool, _ready(1))
        assert pool.launcher == "fresh processes (MLA_FUZZ_ZYGOTE=0)"
        assert _ppid(pool.workers[0].proc.pid) == os.getpid()
    finally:
        pool.close(kill=True)


@pytest.mark.skipif(not zygote.enabled(), reason="MLA_FUZZ_ZYGOTE=0")
def test_a_zygote_whose_imports_fail_leaves_fresh_workers_and_says_why(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    broken = zygote.Zygote(env, sys.executable)
    try:
        assert broken.ready.wait(60)
        assert broken.spawn(["--fd", "{fd}"], env, 1, 2, 10.0) is None
        assert "its imports failed" in broken.reason and "no torch in this test" in broken.reason
        monkeypatch.setattr(zygote, "for_env", lambda env, python=None: broken)
        pool = Pool(worker_envs(1, "emulated", device_count=0, cpu_count=2), tmp_path / "logs")
        pool.start()
        try:
            seen = _until(pool, _ready(1))
            assert [e.kind for e in seen] == ["ready"]
            assert pool.launcher.startswith("fresh processes: ") and "no torch in this test" in pool.launcher
            assert _ppid(pool.workers[0].proc.pid) == os.getpid()
        finally:
            pool.close(kill=True)
    finally:
        broken.close()


def test_commands_that_start_workers_start_the_zygote_first_with_the_workers_import_env(monkeypatch):
    from mla_fuzz.harness import cli

    started = []
    monkeypatch.setattr(zygote, "prestart", lambda env: started.append(env))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cli._prestart_workers(["run", "--graph", "emulated", "--budget", "5s"])
    assert len(started) == 1 and started[0]["TRITON_INTERPRET"] == "1"  # what worker_envs gives CPU workers
    pool_env = dict(os.environ) | worker_envs(2, "emulated", device_count=0)[0]  # as Pool builds it
    assert zygote.import_key(started[0]) == zygote.import_key(pool_env)
    for argv in (["merge", "a.json"], ["replay", "r.json"], ["run", "--help"], [], ["--version"]):
        cli._prestart_workers(argv)
    assert len(started) == 1, started
    cli._prestart_workers(["replay", "--isolate", "r.json"])
    cli._prestart_workers(["mutants", "--graph=emulated"])
    assert len(started) == 3
    # on a GPU machine (the driver's device nodes), before torch: the GPU workers' import env
    for gpu, argv, mode in ((True, ["run", "--graph", "cuda"], "cuda"), (True, ["mutants"], "cuda"),
                            (False, ["mutants"], "emulated"), (True, ["run", "--graph", "eager"], "eager")):
        monkeypatch.setattr(cli, "_gpu_present", lambda gpu=gpu: gpu)
        cli._prestart_workers(argv)
        pool_env = dict(os.environ) | worker_envs(2, mode, device_count=int(gpu))[0]
        assert zygote.import_key(started[-1]) == zygote.import_key(pool_env), (argv, gpu)
    assert "TRITON_INTERPRET" not in dict(started[-1])  # eager on a GPU: compiled kernels


@pytest.mark.skipif(not zygote.enabled(), reason="MLA_FUZZ_ZYGOTE=0")
def test_workers_outlive_a_killed_zygote_and_the_pool_then_starts_fresh_ones(tmp_path, monkeypatch):
    from mla_fuzz.harness.procs import pid_alive

    monkeypatch.setenv("TRITON_MLA_FUZZ_TEST", "a zygote of its own")  # not the one other tests share
    envs = worker_envs(1, "emulated", device_count=0, cpu_count=2)
    key = zygote.import_key(dict(os.environ) | envs[0])
    pool = Pool(envs, tmp_path)
    pool.start()
    try:
        _until(pool, _ready(1))
        first = pool.workers[0].proc.pid
        os.kill(zygote._ZYGOTES[key].proc.pid, signal.SIGKILL)  # the OOM killer's choice, say
        deadline = time.monotonic() + 30
        while not zygote._ZYGOTES[key].dead:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert pid_alive(first), "a worker belongs to the command, not to the zygote"
        os.kill(first, signal.SIGKILL)
        _until(pool, lambda seen: pool.restarts == 1 and pool.workers[0].ready)
        assert _ppid(pool.workers[0].proc.pid) == os.getpid()
        assert pool.launcher.startswith("fresh processes: ") and "it ended" in pool.launcher, pool.launcher
    finally:
        pool.close(kill=True)
        zygote._ZYGOTES.pop(key, None)


_NO_CUDA_PROBE = r"""
import json, sys
import torch
asked = []
def refuse(name):
    def f(*a, **k):
        asked.append(name)
        raise RuntimeError(name + " asked while preloading")
    return f
# anything that runs cuInit in the zygote leaves every forked worker without CUDA
for name in ("is_available", "device_count", "get_device_capability", "get_device_properties",
             "current_device", "init", "_lazy_init", "set_device"):
    setattr(torch.cuda, name, refuse("torch.cuda." + name))
torch._C._cuda_getDeviceCount = refuse("torch._C._cuda_getDeviceCount")
from mla_fuzz.harness import zygote
zygote._preload()
# and not through the driver either (Triton's, say): before cuInit the driver answers
# CUDA_ERROR_NOT_INITIALIZED (3); None where there is no driver
import ctypes
try:
    n = ctypes.c_int()
    driver_initialised = ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(n)) != 3
except OSError:
    driver_initialised = None
print(json.dumps({"asked": asked, "own": [m for m in zygote.OWN_PRELOAD if m in sys.modules],
                  "driver_initialised": driver_initialised}))
"""


@pytest.mark.parametrize("interpret", ["1", None], ids=["interpreted", "compiled"])
def test_the_preload_imports_our_harness_and_kernels_without_asking_cuda_anything(interpret):
    # compiled: Triton's GPU path (its decorators and driver), as on a GPU machine
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    r = subprocess.run([sys.executable, "-c", _NO_CUDA_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["asked"] == [], out
    assert out["own"] == list(zygote.OWN_PRELOAD), out  # imported, not skipped over an error
    assert out["driver_initialised"] is not True, out
