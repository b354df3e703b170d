"""Which Triton kernels a DeepSeek-V3 search still compiles after `mla-fuzz warmup` (on a GPU,
with TRITON_CACHE_DIR set to the cache the warmup filled):

    python3 benchmarks/compiles_after_warmup.py BACKEND EXAMPLES OUT.json

Runs ``fuzz(BACKEND, spec="deepseek-v3", graph_mode="cuda", examples=EXAMPLES, seed=0,
shrink=False)`` with Triton's ``JITFunction._do_compile`` timed: a call over 0.25 s is a
compilation (kept with the kernel's signature, constexprs and specialization attributes),
shorter ones load a variant from the cache. Results:
benchmarks/results/h200-2026-11-29-compiles-after-warmup.json."""

from __future__ import annotations

import json
import sys
import time

#: a variant loaded from Triton's on-disk cache takes milliseconds; a compilation, seconds
COMPILE_S = 0.25


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python3 benchmarks/compiles_after_warmup.py BACKEND EXAMPLES OUT.json", file=sys.stderr)
        return 2
    backend, examples, out = argv[0], int(argv[1]), argv[2]
    from triton.runtime.jit import JITFunction

    log = []
    original = JITFunction._do_compile

    def timed(self, key, signature, device, constexprs, options, attrs, warmup):
        t0 = time.monotonic()
        try:
            return original(self, key, signature, device, constexprs, options, attrs, warmup)
        finally:
            log.append({"fn": getattr(self, "__name__", str(self)), "s": round(time.monotonic() - t0, 3),
                        "sig": {k: str(v) for k, v in dict(signature).items()},
                        "constexprs": {str(k): str(v) for k, v in dict(constexprs).items()},
                        "attrs": str(attrs), "warps": getattr(options, "num_warps", None)})

    JITFunction._do_compile = timed
    from mla_fuzz.harness.fuzz import fuzz

    t0 = time.monotonic()
    r = fuzz(backend, spec="deepseek-v3", graph_mode="cuda", examples=examples, seed=0, shrink=False)
    seconds = round(time.monotonic() - t0, 1)
    compiles = [x for x in log if x["s"] > COMPILE_S]
    with open(out, "w") as f:
        json.dump({"backend": backend, "examples": r.examples, "failed": r.failed, "seconds": seconds,
                   "compiles": compiles, "loads": len(log), "load_s": round(sum(x["s"] for x in log), 2)}, f, indent=1)
    print(backend, r.examples, r.failed, seconds, len(compiles))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
