"""Run a fixed set of scenario steps through the Triton backend (interpreted, emulated
graphs) and save every forward's outputs, bytes as they are, to the file named by argv[1].

Run as a script by ``test_interpreter_speedups.py``, once with
``MLA_FUZZ_PLAIN_INTERPRETER=1`` (Triton's interpreter as shipped) and once without (with
``kernels.interpreter_patches``' caching): each run needs a fresh process, because the
caching patches Triton for the life of the process.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from mla_fuzz.harness.executor import ScenarioRunner  # noqa: E402
from mla_fuzz.kernels import interpreter_patches  # noqa: E402
from mla_fuzz.harness.loading import load_backend  # noqa: E402
from mla_fuzz.harness.scenario import ScenarioConfig  # noqa: E402
from mla_fuzz.mla_ref import ModelSpec  # noqa: E402


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


def _ops_kernel_source():
    """A kernel of the operand shapes the fast paths take (and some they leave to Triton):
    a tensor with a Python int / float on either side (-0.0, nan, inf, a float with an int
    tensor, division), blocks broadcast against each other and against scalars,
    ``x[:, None]`` / ``x[None, :]``, ``tl.where`` with scalars, bf16 / fp16 / fp8 casts and
    loads with ``other=``, pointer + int."""
    import triton
    import triton.language as tl

    @triton.jit
    def ops_kernel(x_ptr, i_ptr, h_ptr, b_ptr, f8_ptr, o_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        i = tl.load(i_ptr + offs)
        hb = tl.load(h_ptr + offs, mask=offs < N - 3, other=0.0)  # fp16, other cast
        bb = tl.load(b_ptr + offs, mask=offs < N - 5, other=-0.0)  # bf16, other cast
        f8 = tl.load(f8_ptr + offs).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        outs = o_ptr + offs[:, None] * 24 + tl.arange(0, 2)[None, :] * 0
        zero2 = tl.zeros([N, 2], dtype=tl.float32)
        tl.store(outs + 0, zero2 + (x + 0.0)[:, None])
        tl.store(outs + 1, zero2 + (x * -0.0)[:, None])
        tl.store(outs + 2, zero2 + (1.0 - x)[:, None])
        tl.store(outs + 3, zero2 + (i + 0.5)[:, None])
        tl.store(outs + 4, zero2 + (i // 3).to(tl.float32)[:, None])
        tl.store(outs + 5, zero2 + (i / 3)[:, None])
        tl.store(outs + 6, zero2 + (7 % (i + 100)).to(tl.float32)[:, None])
        tl.store(outs + 7, zero2 + tl.where(x > 0, x, float("nan"))[:, None])
        tl.store(outs + 8, zero2 + tl.where(i > 2, 1.0, -x)[:, None])
        tl.store(outs + 9, zero2 + (hb * 3.0 + 1).to(tl.float32)[:, None])
        tl.store(outs + 10, zero2 + (bb.to(tl.float32) - float("inf"))[:, None])
        tl.store(outs + 11, zero2 + (x.to(tl.bfloat16) + 1.5).to(tl.float32)[:, None])
        tl.store(outs + 12, zero2 + (x.to(tl.float16) * 2).to(tl.float32)[:, None])
        tl.store(outs + 13, zero2 + f8[:, None])
        tl.store(outs + 14, zero2 + (f8 * 0.1).to(tl.bfloat16).to(tl.float32)[:, None])
        outer = x[:, None] * x[None, :]
        tl.store(outs + 15, zero2 + tl.sum(outer, axis=1)[:, None])
        tl.store(outs + 16, zero2 + tl.max(outer + i[None, :].to(tl.float32), axis=1)[:, None])
        col = (x[:, None] + tl.zeros([N, 2], dtype=tl.float32)) * 2
        tl.store(outs + 17, col)
        tl.store(outs + 18, zero2 + ((i << 2) + (i >> 1) - 1 + (i & 3)).to(tl.float32)[:, None])
        tl.store(outs + 19, zero2 + (tl.load(x_ptr + 1 + offs, mask=offs < N - 1, other=2.0) + 0)[:, None])
        tl.store(outs + 20, zero2 + (x * 0.0 + 0.0)[:, None])
        tl.store(outs + 21, zero2 + (2 ** 40 + i.to(tl.int64)).to(tl.float32)[:, None])
        tl.store(outs + 22, zero2 + (x > 0.5).to(tl.float32)[:, None])
        tl.store(outs + 23, zero2 + (tl.exp2(x - 3.0) * 1e-30 * 1e-10)[:, None])

    return ops_kernel


def run_ops_kernel() -> list:
    """The raw bytes of ``_ops_kernel_source``'s outputs for fixed inputs."""
    n = 16
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n + 1, generator=g)
    x[3] = -0.0
    x[5] = float("nan")
    x[6] = 1e-40  # fp32 subnormal
    i = torch.arange(-5, n - 5, dtype=torch.int32)
    h = (torch.randn(n, generator=g) * 1e-5).half()
    b = torch.randn(n, generator=g).bfloat16()
    f8 = torch.arange(0, 256, 256 // n, dtype=torch.uint8)
    o = torch.zeros(n, 24)
    _ops_kernel_source()[(1,)](x, i, h, b, f8, o, N=n)
    return [o.view(torch.uint8).clone()]


if __name__ == "__main__":
    interpreter_patches.install()  # as the test suite and the fuzzer's workers do
    torch.set_num_threads(1)
    outs = run_ops_kernel() + run()
    import triton.language.core as core
    patched = bool(getattr(core.tensor.__init__, "_mla_fuzz", False))
    torch.save({"outs": outs, "patched": patched}, sys.argv[1])
