"""The environment of each worker process (``worker_envs``), without importing torch: the
command decides which preloaded process (``harness.zygote``) its workers will fork from
before it imports torch, from the same rule."""
from __future__ import annotations

import os


def worker_envs(workers: str | int, mode: str, device_count: int | None = None,
                cpu_count: int | None = None) -> list[dict]:
    """Environment additions for each worker process.

    ``workers``: an int >= 1 or ``"auto"``. GPU modes (``cuda``, and ``eager`` when a GPU is
    visible) give each worker one GPU by ``CUDA_VISIBLE_DEVICES`` (round robin when there are
    more workers than GPUs, so ``N`` workers on one GPU share it; ``auto`` = one per GPU)
    and one intra-op thread; ``MLA_FUZZ_CUDA_EARLY=1`` in the caller's environment has each
    create its CUDA context while it imports (default ``0``). CPU modes (``emulated``, ``eager``
    without a GPU) run the kernels through Triton's interpreter (``TRITON_INTERPRET=1``) with
    no GPU visible; ``auto`` = one per CPU core, and torch's intra-op threads are split among
    the workers so they do not oversubscribe the cores.
    """
    if device_count is None:
        import torch
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = mode == "cuda" or (mode == "eager" and device_count > 0)
    if cpu_count is None:
        try:
            cpu_count = len(os.sched_getaffinity(0))
        except AttributeError:
            cpu_count = os.cpu_count() or 1
    if gpu:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(device_count)]
        ids = ids[:device_count] or ["0"]
        n = len(ids) if workers == "auto" else int(workers)
        # The host side of a GPU worker is many tiny tensor ops (batch building, oracle
        # comparisons): intra-op threads only add spin-waiting, and several workers
        # sharing a GPU box would oversubscribe its cores (measured: a campaign with
        # torch's default threads ran 5x slower on a busy 2-core host). One thread each.
        extra = {"MLA_FUZZ_TORCH_THREADS": "1"}
        # it will use the GPU: where asked, its CUDA context is made while it imports
        # (``harness.cuda_early``; off by default until its effect is measured, docs/cli.md)
        extra["MLA_FUZZ_CUDA_EARLY"] = os.environ.get("MLA_FUZZ_CUDA_EARLY", "0")
        if "OMP_NUM_THREADS" not in os.environ:
            extra["OMP_NUM_THREADS"] = "1"
        return [{"CUDA_VISIBLE_DEVICES": ids[i % len(ids)], **extra} for i in range(n)]
    n = cpu_count if workers == "auto" else int(workers)
    threads = str(max(1, cpu_count // max(n, 1)))
    env = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET") or "1",
           "MLA_FUZZ_TORCH_THREADS": threads}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = threads
    return [dict(env) for _ in range(n)]
