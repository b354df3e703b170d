"""Run a fixed set of scenario steps through the Triton backend (interpreted, emulated
graphs) and save every forward's outputs, bytes as they are, to the file named by argv[1].

Run as a script by ``test_interpreter_speedups.py``, once with
``MLA_FUZZ_PLAIN_INTERPRETER=1`` (Triton's interpreter as shipped) and once without (with
``kernels.config._cache_interpreter_types``): each run needs a fresh process, because the
caching patches Triton for the life of the process.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from harness.executor import ScenarioRunner  # noqa: E402
from harness.loading import load_backend  # noqa: E402
from harness.scenario import ScenarioConfig  # noqa: E402
from mla_ref import ModelSpec  # noqa: E402


def _step(op, size, seqs, qls, mdl, seed=1, **kw):
    return {"op": op, "size": size, "batch": {"seed": seed, "seq_lens": seqs, "q_lens": qls,
                                              "max_decode_len": mdl}, **kw}


def _eager(seqs, qls, mdl, pad_to=None, poison=False, seed=2):
    return {"op": "eager", "batch": {"seed": seed, "seq_lens": seqs, "q_lens": qls, "max_decode_len": mdl},
            "pad_to": pad_to, "poison": poison}


def cases():
    """(config, steps): dense bf16/fp16/fp8 (split requests, MTP, padding, poison, empty rows),
    sparse with engine-selected and on-device (indexer) top-k, and whole layer steps with
    and without FP8 output."""
    tiny = ModelSpec.from_name("tiny").to_dict()

    def cfg(h, **kw):
        return ScenarioConfig(spec={**tiny, "num_heads": h}, **kw)

    return [
        (cfg(4, kv_dtype="bf16", page_size=16, next_n=2, capture_sizes=[4]),
         [_step("capture", 4, [30, 64, 5], [2, 1, 2], 2, warmups=1),
          _step("replay", 4, [100, 0, 17, 33], [2, 0, 1, 2], 2, poison=True),
          _eager([127, 1], [2, 1], 2, pad_to=4, poison=True)]),
        (cfg(3, kv_dtype="fp16", q_dtype="fp16", page_size=4, next_n=4, capture_sizes=[2, 3]),
         [_step("capture", 3, [3, 32, 9], [3, 4, 1], 4, warmups=3, share=True),
          _step("replay", 3, [31, 4], [1, 2], 2)]),
        (cfg(8, kv_dtype="fp8", page_size=64, next_n=1, capture_sizes=[2, 8]),
         [_step("capture", 8, [300, 64, 5, 7, 200], [1, 1, 1, 1, 1], 1),
          _step("replay", 8, [400, 1, 17], [1, 1, 1], 1, poison=True)]),
        (cfg(3, kv_dtype="fp16", q_dtype="fp16", page_size=16, next_n=3, capture_sizes=[2], sparse=True, topk=33),
         [_step("capture", 2, [30, 64], [3, 2], 3), _step("replay", 2, [100, 50], [2, 3], 3, poison=True)]),
        (cfg(16, kv_dtype="fp8", page_size=16, next_n=2, capture_sizes=[2], sparse=True, topk=64, indexer=True),
         [_step("capture", 2, [90, 17], [2, 1], 2), _step("replay", 2, [128, 0], [2, 0], 2)]),
        (cfg(4, kv_dtype="bf16", page_size=16, next_n=1, capture_sizes=[2], layer=True),
         [_step("capture", 2, [30, 64], [1, 1], 1), _step("replay", 2, [10, 50], [1, 1], 1)]),
        (cfg(1, kv_dtype="fp8", page_size=16, next_n=2, capture_sizes=[2], layer=True, fp8_out=True),
         [_step("capture", 2, [33, 16], [2, 1], 2, warmups=1), _step("replay", 2, [60, 2], [1, 2], 2)]),
    ]


def run() -> list:
    """Every forward's outputs (raw bytes), in order, over all the cases."""
    backend = load_backend("triton")
    outs = []
    for cfg, steps in cases():
        cfg.validate()
        runner = ScenarioRunner(backend, cfg, "emulated")
        forward = runner._forward

        def recorded(*args, _forward=forward):
            res = _forward(*args)
            outs.extend(t.detach().clone().contiguous().view(torch.uint8) for t in res)
            return res

        runner._forward = recorded
        try:
            for step in steps:
                runner.apply(step)
        finally:
            runner.close()
    return outs


if __name__ == "__main__":
    torch.set_num_threads(1)
    outs = run()
    import triton.language.core as core
    patched = bool(getattr(core.tensor.__init__, "_mla_fuzz", False))
    torch.save({"outs": outs, "patched": patched}, sys.argv[1])
