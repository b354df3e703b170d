"""Fuzzer throughput: cases/s of real campaigns (``mla-fuzz bench``, ``benchmarks/fuzz_bench.py``).

One time-bounded campaign per run, through the same machinery as ``mla-fuzz run``
(worker processes, chunks, merging), against the clean backend. Runs are laid out as

- ``cuda``: for each GPU count ``g`` in ``gpus`` and each ``k`` in ``per_gpu``, ``g * k``
  workers on the first ``g`` visible GPUs (``k`` processes share each GPU);
- ``emulated`` / ``eager`` on CPU: for each worker count in ``cpu_workers`` (``auto`` = one
  per core), kernels through Triton's interpreter.

Before the timed runs of a (spec, mode), an untimed warm-up campaign fills Triton's on-disk
kernel cache: a campaign on a fresh machine spends most of its first minute compiling
kernel variants (measured on an H200: 2 cases/s cold vs 10 warm, one worker), which a user
pays once, not per campaign. The warm-up's own numbers are recorded too.

The summary compares with the targets of the throughput issue: >= 50 cases/s on one GPU
(tiny spec, cuda), >= 0.85 scaling from 1 to N GPUs (rate on N GPUs over N times the rate
on one, same processes per GPU), >= 2 cases/s per CPU core emulated (tiny spec).
"""
from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

TARGET_GPU_CASES_PER_S = 50.0
TARGET_SCALING = 0.85
TARGET_CPU_CASES_PER_CORE = 2.0
FORMAT = "mla-fuzz-fuzz-bench/2"


@dataclass
class BenchPlan:
    """What to run. Lists are run in order; see the module docstring for the layout."""

    backend: str = "triton"
    specs: tuple = ("tiny",)
    modes: tuple = ("cuda",)
    gpus: tuple = (1,)
    per_gpu: tuple = (1, 8)
    cpu_workers: tuple = (1, "auto")
    budget_s: float = 30.0
    warmup_s: float = 30.0
    seed: int = 0
    chunk: int = 100
    case_timeout: float = 300.0
    # repro files of any failure (the clean backend should have none) go here, as in ``run``
    corpus: str = ".mla-fuzz/corpus"
    # cuda runs under private MPS daemons, one per GPU (harness.mps): several workers per GPU scale
    mps: bool = False
    # the longest sequence drawn (None: per spec and device, as ``run``)
    max_seq_len: int | None = None


def visible_gpu_ids() -> list[str]:
    """CUDA device ids workers may be pinned to (honours ``CUDA_VISIBLE_DEVICES``)."""
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(n)]
    return ids[:n]


def run_campaign(plan: BenchPlan, spec: str, mode: str, envs: list[dict], budget_s: float, seed: int,
                 mps_daemons=None) -> dict:
    """One campaign; its throughput as a dict (cases = scenarios, each starting with a capture)."""
    from .campaign import CampaignOptions, CampaignRun

    opts = CampaignOptions(backend=plan.backend, graph=mode, spec=spec, budget_s=budget_s, examples=None,
                           seed=seed, corpus=Path(plan.corpus), worker_envs=envs, case_timeout=plan.case_timeout,
                           chunk=plan.chunk, mps=mps_daemons is not None, mps_daemons=mps_daemons,
                           max_seq_len=plan.max_seq_len)
    res = CampaignRun(opts).run(handle_sigint=False)
    steady = None
    if res.startup_s is not None and res.elapsed > res.startup_s:
        steady = res.examples / (res.elapsed - res.startup_s)
    gpus = sorted({e.get("CUDA_VISIBLE_DEVICES") for e in envs if e.get("CUDA_VISIBLE_DEVICES")})
    return {
        "spec": spec, "mode": mode, "workers": len(envs), "gpus": len(gpus), "mps": opts.mps,
        "per_gpu": (len(envs) // len(gpus)) if gpus else None,
        "examples": res.examples, "steps": res.steps, "chunks": res.chunks,
        "elapsed_s": round(res.elapsed, 3), "startup_s": None if res.startup_s is None else round(res.startup_s, 3),
        "cases_per_s": round(res.rate, 4), "cases_per_s_steady": None if steady is None else round(steady, 4),
        "steps_per_s": round(res.steps / res.elapsed, 4) if res.elapsed else None,
        "cases_per_s_per_worker": round(res.rate / max(len(envs), 1), 4),
        "failures": [f.to_dict() for f in res.findings.values()], "errors": res.errors, "restarts": res.restarts,
    }


def _gpu_envs(ids: list[str], per_gpu: int) -> list[dict]:
    from .worker_env import worker_envs

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    try:
        return worker_envs(per_gpu * len(ids), "cuda", device_count=len(ids))
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def layout(plan: BenchPlan, mode: str, gpu_ids: list[str], cpu_count: int) -> list[list[dict]]:
    """Worker environments of every timed run of ``mode``, in order (GPU counts above
    ``len(gpu_ids)`` left out)."""
    from .worker_env import worker_envs

    if mode == "cuda":
        return [_gpu_envs(gpu_ids[:g], k) for g in plan.gpus if g <= len(gpu_ids) for k in plan.per_gpu]
    return [worker_envs(w, mode, device_count=0, cpu_count=cpu_count) for w in plan.cpu_workers]


def summarize(runs: list[dict]) -> dict:
    """Headline figures against the targets (module docstring)."""
    out: dict = {}
    ok = [r for r in runs if "cases_per_s" in r and not r.get("warmup")]
    one_gpu = [r for r in ok if r["spec"] == "tiny" and r["mode"] == "cuda" and r["gpus"] == 1]
    if one_gpu:
        best = max(one_gpu, key=lambda r: r["cases_per_s"])
        out["tiny_cuda_one_gpu_best_cases_per_s"] = best["cases_per_s"]
        out["tiny_cuda_one_gpu_best_workers"] = best["workers"]
        out["tiny_cuda_one_gpu_target"] = TARGET_GPU_CASES_PER_S
        out["tiny_cuda_one_gpu_met"] = best["cases_per_s"] >= TARGET_GPU_CASES_PER_S
    scaling = []
    for r in ok:
        if r["mode"] != "cuda" or r["gpus"] < 2:
            continue
        base = [b for b in ok if b["mode"] == "cuda" and b["spec"] == r["spec"] and b["gpus"] == 1
                and b["per_gpu"] == r["per_gpu"]]
        if base and base[0]["cases_per_s"] > 0:
            eff = r["cases_per_s"] / (r["gpus"] * base[0]["cases_per_s"])
            scaling.append({"spec": r["spec"], "gpus": r["gpus"], "per_gpu": r["per_gpu"],
                            "efficiency": round(eff, 3), "met": eff >= TARGET_SCALING})
    if scaling:
        out["gpu_scaling"] = scaling
        out["gpu_scaling_target"] = TARGET_SCALING
    cpu = [r for r in ok if r["spec"] == "tiny" and r["mode"] == "emulated"]
    if cpu:
        best = max(cpu, key=lambda r: r["cases_per_s_per_worker"])
        out["tiny_emulated_best_cases_per_s_per_core"] = best["cases_per_s_per_worker"]
        out["tiny_emulated_target_per_core"] = TARGET_CPU_CASES_PER_CORE
        out["tiny_emulated_met"] = best["cases_per_s_per_worker"] >= TARGET_CPU_CASES_PER_CORE
    return out


def _runs(plan: BenchPlan, ids: list[str], cpu_count: int, note, mps_daemons) -> None:
    """Warm-up and timed campaigns of every (spec, mode), each record handed to ``note``."""
    for spec in plan.specs:
        for mode in plan.modes:
            if mode == "cuda" and not ids:
                note({"spec": spec, "mode": mode, "skipped": "no CUDA device"})
                continue
            if mode == "cuda":
                for g in plan.gpus:
                    if g > len(ids):
                        note({"spec": spec, "mode": mode, "gpus": g,
                              "skipped": f"{g} GPUs asked, {len(ids)} visible"})
            envs_list = layout(plan, mode, ids, cpu_count)
            if not envs_list:
                continue
            if plan.warmup_s > 0:
                widest = max(envs_list, key=len)
                rec = run_campaign(plan, spec, mode, widest, plan.warmup_s, plan.seed + 7919,
                                   mps_daemons if mode == "cuda" else None)
                note({**rec, "warmup": True})
            for envs in envs_list:
                note(run_campaign(plan, spec, mode, envs, plan.budget_s, plan.seed,
                                  mps_daemons if mode == "cuda" else None))


def run_bench(plan: BenchPlan, *, on_run: Optional[Callable[[dict], None]] = None,
              cpu_count: Optional[int] = None) -> dict:
    """Every run of ``plan``; the JSON document (``format`` ``mla-fuzz-fuzz-bench/2``).

    ``on_run(record)`` is called after each campaign (warm-ups included, marked
    ``warmup: true``) so a caller can print progress. ``cuda`` runs are skipped (recorded
    with ``skipped``) without a GPU, as are GPU counts above what is visible."""
    import torch

    if cpu_count is None:
        try:
            cpu_count = len(os.sched_getaffinity(0))
        except AttributeError:
            cpu_count = os.cpu_count() or 1
    ids = visible_gpu_ids()
    runs: list[dict] = []

    def note(rec: dict) -> None:
        runs.append(rec)
        if on_run is not None:
            on_run(rec)

    # the same MPS daemons (one per GPU) for every cuda run, as a user's single campaign has
    # them: starting daemons per campaign left the previous ones' servers competing for the GPU
    daemon = None
    if plan.mps and "cuda" in plan.modes and ids:
        from .mps import MpsDaemons
        daemon = MpsDaemons(ids[:max(plan.gpus)]).start()
    try:
        _runs(plan, ids, cpu_count, note, daemon)
    finally:
        if daemon is not None:
            daemon.stop()
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "cpus": cpu_count, "platform": platform.platform()},
        "versions": {"torch": torch.__version__, "triton": triton_version,
                     "device": torch.cuda.get_device_name() if cuda else "cpu",
                     "gpus": len(ids)},
        "plan": {k: (list(v) if isinstance(v, tuple) else v) for k, v in plan.__dict__.items()},
        "runs": runs, "summary": summarize(runs),
    }


def run_line(r: dict) -> str:
    """One table row for a run record."""
    if "skipped" in r:
        return f"{r['spec']:<12} {r['mode']:<9} skipped: {r['skipped']}"
    steady = "-" if r.get("cases_per_s_steady") is None else f"{r['cases_per_s_steady']:.2f}"
    gpus = "-" if not r.get("gpus") else str(r["gpus"])
    tag = " (warm-up, not counted)" if r.get("warmup") else ""
    fails = len(r["failures"])
    return (f"{r['spec']:<12} {r['mode']:<9} {gpus:>4} {r['workers']:>7} {r['examples']:>7} {r['steps']:>7} "
            f"{r['elapsed_s']:>7.1f} {r['cases_per_s']:>8.2f} {steady:>8} {r['cases_per_s_per_worker']:>8.2f} "
            f"{fails:>5}{tag}" + (f"  errors: {r['errors']}" if r["errors"] else ""))


HEADER = (f"{'spec':<12} {'mode':<9} {'gpus':>4} {'workers':>7} {'cases':>7} {'steps':>7} {'wall s':>7} "
          f"{'cases/s':>8} {'steady':>8} {'/worker':>8} {'fails':>5}")


def summary_lines(summary: dict) -> list[str]:
    """The headline figures, one line each, with the target and whether it is met."""
    lines = []
    if "tiny_cuda_one_gpu_best_cases_per_s" in summary:
        s = summary
        lines.append(f"tiny, cuda, one GPU: {s['tiny_cuda_one_gpu_best_cases_per_s']:.1f} cases/s "
                     f"({s['tiny_cuda_one_gpu_best_workers']} workers); target >= {s['tiny_cuda_one_gpu_target']:g}: "
                     + ("met" if s["tiny_cuda_one_gpu_met"] else "NOT met"))
    for sc in summary.get("gpu_scaling", []):
        lines.append(f"{sc['spec']}, cuda, 1 -> {sc['gpus']} GPUs at {sc['per_gpu']} workers/GPU: scaling "
                     f"{sc['efficiency']:.2f}; target >= {TARGET_SCALING:g}: " + ("met" if sc["met"] else "NOT met"))
    if "tiny_emulated_best_cases_per_s_per_core" in summary:
        s = summary
        lines.append(f"tiny, emulated: {s['tiny_emulated_best_cases_per_s_per_core']:.2f} cases/s per core; target >= "
                     f"{s['tiny_emulated_target_per_core']:g}: " + ("met" if s["tiny_emulated_met"] else "NOT met"))
    return lines
