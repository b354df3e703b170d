"""Would FP8 tensor-core dots keep FP8-cache decode accurate? A CPU emulation (no GPU needed).

The FP8 decode kernels convert every cached e4m3 code to a 16-bit value in shared memory
before their dots (``kernels/decode_wgmma_ws.py``, ``decode_wgmma_ws64.py``); that
conversion and its shared-memory traffic are what bound their tiles (README, "Where a small
launch's time goes"). Hopper's e4m3 dots would read the codes as they are, but both operands
must then be e4m3: q (bf16) and the probabilities P (fp32) would have to be rounded to 4
significant bits. This script measures what splitting each of them into two e4m3 terms,
``x = hi + lo`` with ``hi = e4m3(x)`` and ``lo = e4m3(x - hi)``, costs in accuracy, against
the shipped kernels' numerics and an fp64 reference, for one request of ``h`` rows over ``L``
keys in 64-key tiles (the kernels' online softmax, tile by tile):

- ``reference``: fp64 softmax attention over the dequantised keys (``code * scale``);
- ``shipped``: the ws kernel's numerics -- codes exact in fp16, q times a power of two in
  fp16, group scales on the four group dots' results, ``P^T * scale_g * 2**8`` in fp16, fp32
  accumulation;
- ``fp8_dots``: q times a power of two into e4m3's range then split hi + lo; each group's
  ``P * scale_g`` times a power of two (per tile and group) split hi + lo; every dot an e4m3
  product summed in chunks of 32 (one wgmma's K) into an accumulator that keeps
  ``--acc-bits`` mantissa bits (Hopper's FP8 accumulation keeps about 14, DeepSeek-V3
  report, section 3.3.2), the online softmax's rescales in fp32.

Output: per distribution of the inputs and accumulator width, each path's worst error against the reference as the
GPU tests measure it (``|out - ref| / (atol + rtol |ref|)`` with bf16's tolerances,
``tests/kernels_cases.TOL_GPU``: a value <= 1 passes) and its largest absolute error.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mla_ref import ModelSpec  # noqa: E402
from mla_ref.fp8 import quantize_kv_fp8, split_fp8_tokens  # noqa: E402

E4M3 = torch.float8_e4m3fn
#: bf16 outputs on the GPU: (atol, rtol), as tests/kernels_cases.TOL_GPU
BF16_TOL = (2e-2, 2e-2)
TILE = 64


def pow2_under(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The power of two ``2**k`` (fp32, ``amax``'s shape) with ``amax * 2**k <= limit`` and
    ``k`` as large as that allows, at most 126; 1 where ``amax`` is 0 or not finite."""
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    # k within fp32's normal exponents: a tiny amax must not give an infinite factor (0 * inf)
    k = torch.floor(torch.log2(limit / safe)).clamp(-126, 126)
    scale = torch.exp2(k)
    # log2 may land a step high: step down where the product passes the limit
    scale = torch.where(safe * scale > limit, scale / 2, scale)
    return torch.where(ok, scale, torch.ones_like(amax))


def split_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, already within e4m3's range) as two e4m3 tensors ``hi + lo``: ``hi`` the
    nearest e4m3 to ``x``, ``lo`` the nearest to what is left."""
    hi = x.clamp(-448, 448).to(E4M3)
    lo = (x - hi.float()).clamp(-448, 448).to(E4M3)
    return hi, lo


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (fp32) with its mantissa cut to ``bits`` explicit bits (toward zero), as a
    narrow accumulator keeps a sum; ``bits >= 23`` returns ``x``."""
    if bits >= 23:
        return x
    mask = ~((1 << (23 - bits)) - 1) & 0xFFFFFFFF
    return (x.view(torch.int32) & torch.tensor(mask, dtype=torch.int64).to(torch.int32)).view(torch.float32)


def narrow_dot(a: torch.Tensor, b: torch.Tensor, bits: int, chunk: int = 32) -> torch.Tensor:
    """``a @ b`` (fp32 ``[M, K]`` x ``[K, N]`` of exactly representable products) summed ``chunk``
    of K at a time, each partial sum exact, the running total kept to ``bits`` mantissa bits."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k0 in range(0, a.shape[1], chunk):
        part = (a[:, k0:k0 + chunk].double() @ b[k0:k0 + chunk].double()).float()
        acc = round_mantissa(acc + part, bits)
    return acc


def make_inputs(h: int, length: int, dist: str, gen: torch.Generator, spec: ModelSpec):
    """One request: q bf16 ``[h, 576]``, its cache tokens uint8 ``[L, 656]``. ``dist``:
    ``normal`` (all N(0, 1)), ``outliers`` (1% of latent values x 50), ``big_q`` (q x 300),
    ``peaked`` (q aligned with a few keys: a sharp softmax)."""
    lat = torch.randn(length, spec.kv_lora_rank, generator=gen)
    rope = torch.randn(length, spec.qk_rope_head_dim, generator=gen)
    q = torch.randn(h, spec.d_qk, generator=gen)
    if dist == "outliers":
        lat = torch.where(torch.rand(lat.shape, generator=gen) < 0.01, lat * 50, lat)
    elif dist == "big_q":
        q = q * 300
    elif dist == "peaked":
        pick = torch.randint(0, length, (h,), generator=gen)
        q[:, :spec.kv_lora_rank] += 0.5 * lat[pick]
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return q.to(torch.bfloat16), quantize_kv_fp8(lat, rope, spec=spec)


def run_paths(q: torch.Tensor, packed: torch.Tensor, spec: ModelSpec, acc_bits: int) -> dict:
    """The three paths' outputs (module doc) for q bf16 ``[h, 576]`` over tokens uint8
    ``[L, 656]``: ``{"reference": fp64 [h, 512], "shipped": fp32, "fp8_dots": fp32}``."""
    codes, scales, rope = split_fp8_tokens(packed, spec=spec)
    rank, group = spec.kv_lora_rank, spec.fp8_group
    ng = rank // group
    c = codes.float()  # [L, rank], exact
    sc = scales  # [L, ng]
    qs = spec.softmax_scale * math.log2(math.e)
    q_lat, q_rope = q[:, :rank].float(), q[:, rank:].float()
    # reference, fp64 over the dequantised keys (code * scale is exact in fp64)
    k_deq = (c.double().reshape(-1, ng, group) * sc.double()[:, :, None]).reshape(-1, rank)
    s = (q_lat.double() @ k_deq.T + q_rope.double() @ rope.double().T) * qs
    p = torch.exp2(s - s.max(dim=1, keepdim=True).values)
    ref = (p @ k_deq) / p.sum(dim=1, keepdim=True)
    out = {"reference": ref}
    # q's power-of-two row factors: fp16 below 2**15 (shipped), e4m3 below 2**8 (fp8 dots)
    amax = q_lat.abs().amax(dim=1)
    q16 = pow2_under(amax, 2.0 ** 15)
    q8 = pow2_under(amax, 2.0 ** 8)
    q_hi, q_lo = split_e4m3(q_lat * q8[:, None])
    for path in ("shipped", "fp8_dots"):
        m = torch.full((q.shape[0],), float("-inf"))
        l_sum = torch.zeros(q.shape[0])
        acc = torch.zeros(q.shape[0], rank)
        for t0 in range(0, c.shape[0], TILE):
            ct, st, rt = c[t0:t0 + TILE], sc[t0:t0 + TILE], rope[t0:t0 + TILE].float()
            s_t = (q_rope @ rt.T)  # rope dot: bf16 operands, fp32 accumulation in both paths
            for g in range(ng):
                cg = ct[:, g * group:(g + 1) * group]
                if path == "shipped":
                    qg = (q_lat[:, g * group:(g + 1) * group] * q16[:, None]).half().float()
                    dot = (qg @ cg.T) / q16[:, None]
                else:
                    hi = q_hi[:, g * group:(g + 1) * group].float()
                    lo = q_lo[:, g * group:(g + 1) * group].float()
                    dot = (narrow_dot(hi, cg.T, acc_bits) + narrow_dot(lo, cg.T, acc_bits)) / q8[:, None]
                s_t = s_t + dot * st[:, g][None, :]
            s_t = s_t * qs
            m_new = torch.maximum(m, s_t.max(dim=1).values)
            alpha = torch.exp2(m - m_new)
            p_t = torch.exp2(s_t - m_new[:, None])  # [h, tile] fp32
            l_sum = l_sum * alpha + p_t.sum(dim=1)
            parts = []
            for g in range(ng):
                cg = ct[:, g * group:(g + 1) * group]
                w = p_t * st[:, g][None, :]  # P times the keys' group scale
                if path == "shipped":
                    pv = (w * 256.0).half().float() @ cg / 256.0
                else:
                    f = pow2_under(w.abs().amax(), 2.0 ** 8)
                    hi, lo = split_e4m3(w * f)
                    pv = (narrow_dot(hi.float(), cg, acc_bits) + narrow_dot(lo.float(), cg, acc_bits)) / f
                parts.append(pv)
            acc = acc * alpha[:, None] + torch.cat(parts, dim=1)
            m = m_new
        out[path] = acc / l_sum[:, None]
    return out


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """``{"tol_ratio": max |got - ref| / (atol + rtol |ref|) at bf16's GPU tolerances,
    "max_abs": max |got - ref|}`` (got rounded to bf16 first, as the kernels store it)."""
    g = got.to(torch.bfloat16).double()
    atol, rtol = BF16_TOL
    d = (g - ref).abs()
    return {"tol_ratio": float((d / (atol + rtol * ref.abs())).max()), "max_abs": float(d.max())}


def main(argv=None) -> int:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--length", type=int, default=1024, help="keys (a multiple of 64)")
    p.add_argument("--dists", default="normal,outliers,big_q,peaked")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--acc-bits", default="23,13,10", help="comma-separated mantissa bits the FP8 dots' accumulator "
                   "keeps (23: exact fp32 sums)")
    p.add_argument("--out", default=None, help="json path (default: print only)")
    a = p.parse_args(argv)
    try:
        bits = [int(x) for x in a.acc_bits.split(",") if x]
    except ValueError:
        bits = []
    if a.heads < 1 or a.length < TILE or a.length % TILE or a.seeds < 1 or not bits or \
            not all(1 <= b <= 23 for b in bits):
        raise SystemExit("--heads >= 1, --length a positive multiple of 64, --seeds >= 1, --acc-bits integers "
                         "in 1..23")
    spec = ModelSpec(num_heads=a.heads)
    rows = []
    for dist in filter(None, a.dists.split(",")):
        for seed in range(a.seeds):
            gen = torch.Generator().manual_seed(seed)
            try:
                q, packed = make_inputs(a.heads, a.length, dist, gen, spec)
            except ValueError as e:
                raise SystemExit(str(e))
            for b in bits:
                outs = run_paths(q, packed, spec, b)
                r = {"dist": dist, "seed": seed, "acc_bits": b,
                     **{k: errors(outs[k], outs["reference"]) for k in ("shipped", "fp8_dots")}}
                rows.append(r)
                print(json.dumps(r), flush=True)
    worst = {}
    for r in rows:
        w = worst.setdefault(f"{r['dist']} acc_bits={r['acc_bits']}", {"shipped": 0.0, "fp8_dots": 0.0})
        for k in w:
            w[k] = max(w[k], r[k]["tol_ratio"])
    for k, w in worst.items():
        print(f"{k:>28}: worst |err| / tolerance shipped {w['shipped']:.3f}, fp8 dots {w['fp8_dots']:.3f}")
    res = {"heads": a.heads, "length": a.length, "seeds": a.seeds, "tolerance_atol_rtol": BF16_TOL,
           "worst_tol_ratio": worst, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
