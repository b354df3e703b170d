"""How does the GPU running out of memory during a step look to the harness? (GPU only.)

Workers share one GPU, so a step can run out of memory because of the other workers; the
harness must report that as ``DeviceOutOfMemory`` (the environment), never as a finding.
``torch.OutOfMemoryError`` is recognised, but an allocation that fails *during a CUDA-graph
capture* can surface otherwise: the caching allocator frees cached blocks to retry, and a
``cudaFree`` during capture invalidates the capture (pytorch/pytorch PR #187795), so the
backend's ``torch.empty`` raises a CUDA error about the capture instead.

This probe runs our clean backend at DeepSeek-V3 size through an eager step (which leaves
freed blocks in the allocator's cache), then holds all but ``margin`` bytes of the GPU's free
memory and runs one more step (capture, replay or eager), with ``blame.OOM_IS_ENVIRONMENT`` on
as in a pool's worker. Per case it records what the step raised (the exception chain's types
and first lines), what the harness made of it (``DeviceOutOfMemory`` or an oracle failure and
its message), the allocator's counters, and whether the process still runs CUDA work after.

    python3 ci/probe_capture_oom.py OUT.json
"""
from __future__ import annotations

import json
import sys
import time
import traceback


def _batch(seed: int, lens: list) -> dict:
    return {"seed": seed, "seq_lens": lens, "q_lens": [1 if n else 0 for n in lens], "max_decode_len": 1}


def _case(op: str, margin: int) -> dict:
    import torch

    from mla_fuzz.harness import blame
    from mla_fuzz.harness.blame import DeviceOutOfMemory, chain
    from mla_fuzz.harness.executor import ScenarioRunner
    from mla_fuzz.harness.oracles import OracleFailure
    from mla_fuzz.harness.scenario import ScenarioConfig
    from mla_fuzz.kernels import TritonMLABackend
    from mla_fuzz.mla_ref import ModelSpec

    spec = ModelSpec.from_name("deepseek-v3")
    cfg = ScenarioConfig(spec=spec.to_dict(), kv_dtype="bf16", q_dtype="bf16", page_size=64, next_n=1,
                         capture_sizes=[8], max_pages_per_seq=64, seed=1)
    long = [4096] * 8
    first = {"op": "eager", "batch": _batch(1, long), "pad_to": None, "poison": False}
    steps = {"capture": {"op": "capture", "size": 8, "batch": _batch(2, long), "warmups": 0, "share": False},
             "eager": {"op": "eager", "batch": _batch(3, long), "pad_to": None, "poison": False}}
    out = {"op": op, "margin_mib": margin >> 20}
    blame.OOM_IS_ENVIRONMENT = True
    runner = ScenarioRunner(TritonMLABackend, cfg, "cuda", torch.device("cuda"))
    hog = None
    try:
        runner.apply(first)
        if op == "replay":
            runner.apply(steps["capture"])
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        free, _total = torch.cuda.mem_get_info()
        out["cached_free_mib"] = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) >> 20
        # all of the free memory in one allocation may not fit (the driver's own granularity):
        # step down until it does
        want = max(0, free - margin)
        while hog is None:
            try:
                hog = torch.empty(want, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                if want < (64 << 20):
                    raise
                want -= 16 << 20
        out["hog_short_of_free_mib"] = (free - want) >> 20
        step = steps["capture"] if op == "capture" else (
            {"op": "replay", "size": 8, "batch": _batch(4, long), "poison": False} if op == "replay" else steps["eager"])
        t0 = time.monotonic()
        try:
            runner.apply(step)
            out["result"] = "passed"
        except DeviceOutOfMemory as e:
            out["result"] = "DeviceOutOfMemory"
            out["message"] = str(e)[:400]
        except OracleFailure as f:
            out["result"] = f"finding: {f.oracle}"
            out["message"] = f.message[:600]
            cause = f.__cause__
            out["chain"] = [f"{type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                            for e in (chain(cause) if cause is not None else [])]
        except BaseException as e:  # noqa: BLE001 - recorded, the probe goes on
            out["result"] = f"raised {type(e).__name__}"
            out["message"] = "".join(traceback.format_exception_only(type(e), e))[:600]
        out["seconds"] = round(time.monotonic() - t0, 3)
        after = torch.cuda.memory_stats()
        out["counters"] = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "num_ooms",
                                                                            "num_device_alloc", "num_device_free")}
    finally:
        del hog
        try:
            runner.close()
        except BaseException as e:  # noqa: BLE001
            out["close"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    try:
        x = torch.ones(1 << 20, device="cuda")
        torch.cuda.synchronize()
        out["cuda_after"] = "ok" if float(x.sum()) == float(1 << 20) else "wrong result"
    except BaseException as e:  # noqa: BLE001
        out["cuda_after"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


def main(argv=None) -> int:
    import subprocess
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].startswith("--case="):
        op, margin = argv[0][len("--case="):].split(":")
        print(json.dumps(_case(op, int(margin) << 20)))
        return 0
    if len(argv) != 1:
        print("usage: python3 ci/probe_capture_oom.py OUT.json", file=sys.stderr)
        return 2
    rows = []
    for op in ("capture", "replay", "eager"):
        for margin in (0, 256):
            # one process per case: a case may leave its CUDA context unusable
            p = subprocess.run([sys.executable, __file__, f"--case={op}:{margin}"], capture_output=True, text=True,
                               timeout=300)
            try:
                row = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                row = {"op": op, "margin_mib": margin, "result": f"probe exit {p.returncode}",
                       "stderr": p.stderr[-800:]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(argv[0], "w") as f:
        json.dump({"format": "mla-fuzz-capture-oom-probe/1", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
