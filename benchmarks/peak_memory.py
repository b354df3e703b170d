"""Run a command and record the peak CUDA memory of every Python process it starts.

    python3 benchmarks/peak_memory.py --out peak.json -- python3 -m mla_fuzz.harness.cli run ...

Each process of the command (a campaign's workers are its grandchildren) loads a
``sitecustomize`` put first on ``PYTHONPATH`` whose thread writes
``torch.cuda.max_memory_reserved()`` to a file twice a second once torch has a CUDA context:
PyTorch's own count of the memory it holds (CUDA graph pools included; the CUDA context
itself apart), per process, so commands measured side by side on one GPU do not count each
other and a killed worker's last figure survives. Works for any version of the code under
test (no change to it). Writes ``{"command", "exit_code", "seconds", "peak_mib",
"per_process_mib"}`` (``peak_mib``: the largest process); exits with the command's status.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HOOK = '''
import os, sys, threading, time

def _watch(path):
    peak = -1
    while True:
        time.sleep(0.5)
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                continue
            now = max(torch.cuda.max_memory_reserved(d) for d in range(torch.cuda.device_count()))
        except Exception:
            continue
        if now > peak:
            peak = now
            with open(path, "w") as fh:
                fh.write(str(now))

threading.Thread(target=_watch, args=(os.path.join(os.environ["MLA_FUZZ_PEAK_DIR"], str(os.getpid())),),
                 daemon=True).start()
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the json goes")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    with tempfile.TemporaryDirectory(prefix="mla-fuzz-peak-") as tmp:
        hook, peaks = Path(tmp, "hook"), Path(tmp, "peaks")
        hook.mkdir()
        peaks.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        env = dict(os.environ, MLA_FUZZ_PEAK_DIR=str(peaks),
                   PYTHONPATH=os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p))
        t0 = time.monotonic()
        code = subprocess.run(cmd, env=env).returncode
        time.sleep(1.0)  # the last half-second's figure
        per = {p.name: round(int(p.read_text() or 0) / 2**20, 1) for p in peaks.iterdir()}
    Path(args.out).write_text(json.dumps({"command": cmd, "exit_code": code, "seconds": round(time.monotonic() - t0, 1),
                                          "peak_mib": max(per.values(), default=0.0), "per_process_mib": per},
                                         indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
