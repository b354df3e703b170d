"""Would FP8 tensor-core dots keep FP8-cache decode accurate? A CPU emulation (no GPU needed).

The FP8 decode kernels convert every cached e4m3 code to a 16-bit value in shared memory
before their dots (``kernels/hopper/decode_wgmma_ws.py``, ``decode_wgmma_ws64.py``); that
conversion and its shared-memory traffic are what bound their tiles
(``docs/kernel-performance.md``, "Where a small launch's time goes"). Hopper's e4m3 dots
would read the codes as they are, but both operands must then be e4m3: q (bf16) and the
probabilities P (fp32) would have to be rounded to 4 significant bits. This script measures what splitting each of them into two e4m3 terms,
``x = hi + lo`` with ``hi = e4m3(x)`` and ``lo = e4m3(x - hi)``, costs in accuracy, against
the shipped kernels' numerics and an fp64 reference, for one request of ``h`` rows over ``L``
keys in 64-key tiles (the kernels' online softmax, tile by tile):

- ``reference``: the oracle, ``mla_ref.mla_decode``, in fp64 (keys ``code * scale``);
- ``shipped``: the ws kernel's numerics -- codes exact in fp16, q times a power of two in
  fp16, group scales on the four group dots' results, ``P^T * scale_g * 2**8`` in fp16, fp32
  accumulation;
- ``fp8_dots``: q times a power of two into e4m3's range then split hi + lo; each group's
  ``P * scale_g`` times a power of two (per tile and group) split hi + lo; every dot's e4m3
  products summed 32 at a time (one wgmma's K) in one of three ways (``--modes``,
  ``narrow_dot``): ``exact``; ``tensor_core``, each chunk's products and the running
  accumulator aligned to the largest of them and cut ``--bits`` bits below it, as Hopper's FP8
  tensor cores add (``probe_accumulation`` measures 13 bits on an H200, within a chunk and
  across chunks alike; DeepSeek-V3's report, section 3.3.2, says about 14); ``promoted``, each
  chunk's products so, but their sum added to an fp32 accumulator outside the tensor cores.
  The online softmax's rescales are fp32.

Output: per input distribution and summing mode, each path's worst error against the
reference as the GPU tests measure it (``|out - ref| / (atol + rtol |ref|)`` with bf16's
tolerances, ``tests/kernels_cases.TOL_GPU``: a value <= 1 passes) and its largest absolute
error; with ``--probe`` (GPU), the probe's measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mla_fuzz.mla_ref import ModelSpec, mla_decode  # noqa: E402
from mla_fuzz.mla_ref.fp8 import quantize_kv_fp8, split_fp8_tokens  # noqa: E402

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


#: the ways ``narrow_dot`` sums its products (module doc)
MODES = ("exact", "tensor_core", "promoted")


def align_truncate(terms: torch.Tensor, bits: int) -> torch.Tensor:
    """Each of ``terms`` (float64 ``[..., T]``: the addends of one sum along the last axis) cut
    toward zero to a multiple of ``2**(e - bits)``, ``e`` the exponent of the largest ``|term|``
    of its sum: an adder that aligns its addends to the largest and keeps ``bits`` bits below its
    leading one (what ``probe_accumulation`` measures, 13 on Hopper). Zeros stay zero."""
    big = terms.abs().amax(dim=-1, keepdim=True)
    e = torch.floor(torch.log2(torch.where(big > 0, big, torch.ones_like(big))))
    step = torch.exp2(e - bits)
    return torch.trunc(terms / step) * step


def narrow_dot(a: torch.Tensor, b: torch.Tensor, mode: str, bits: int = 13, chunk: int = 32) -> torch.Tensor:
    """``a @ b`` (fp32 ``[M, K]`` x ``[K, N]`` whose products are exact, as e4m3 x e4m3 are) summed
    ``chunk`` of K at a time (one wgmma's K) into an fp32 ``[M, N]`` accumulator. ``mode``:
    ``exact`` every chunk's sum exact, then added in fp32; ``tensor_core`` each chunk's products
    and the running accumulator summed together by ``align_truncate``'s adder (no promotion);
    ``promoted`` each chunk's products summed by that adder alone and the sum added to the
    accumulator in fp32 (a fresh accumulator a chunk, as DeepSeek-V3's FP8 GEMMs promote)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k0 in range(0, a.shape[1], chunk):
        prods = a[:, k0:k0 + chunk, None].double() * b[None, k0:k0 + chunk, :].double()  # [M, C, N]
        prods = prods.transpose(1, 2)  # [M, N, C]: one sum per output element on the last axis
        if mode == "exact":
            acc = acc + prods.sum(dim=-1).float()
        elif mode == "promoted":
            acc = acc + align_truncate(prods, bits).sum(dim=-1).float()
        else:
            terms = torch.cat([prods, acc.double()[..., None]], dim=-1)
            acc = align_truncate(terms, bits).sum(dim=-1).float()
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


def run_paths(q: torch.Tensor, packed: torch.Tensor, spec: ModelSpec, mode: str, bits: int = 13) -> dict:
    """The three paths' outputs (module doc) for q bf16 ``[h, 576]`` over tokens uint8
    ``[L, 656]``: ``{"reference": fp64 [h, 512], "shipped": fp32, "fp8_dots": fp32}``."""
    codes, scales, rope = split_fp8_tokens(packed, spec=spec)
    rank, group = spec.kv_lora_rank, spec.fp8_group
    ng = rank // group
    c = codes.float()  # [L, rank], exact
    sc = scales  # [L, ng]
    qs = spec.softmax_scale * math.log2(math.e)
    q_lat, q_rope = q[:, :rank].float(), q[:, rank:].float()
    # reference: the oracle in fp64 (q fp64 makes it compute in fp64), the request on one page
    length = packed.shape[0]
    ref, _ = mla_decode(q.double()[None, None], packed[None], torch.zeros(1, 1, dtype=torch.int32),
                        torch.tensor([length], dtype=torch.int32), spec=spec)
    out = {"reference": ref[0, 0]}
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
                    dot = (narrow_dot(hi, cg.T, mode, bits) + narrow_dot(lo, cg.T, mode, bits)) / q8[:, None]
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
                    pv = (narrow_dot(hi.float(), cg, mode, bits) + narrow_dot(lo.float(), cg, mode, bits)) / f
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


def probe_accumulation(device: str = "cuda", fast_accum: bool = True) -> dict:
    """How much of a small product an FP8 GEMM on this GPU keeps next to a large one
    (``torch._scaled_mm``, e4m3 x e4m3 into fp32, ``use_fast_accum=fast_accum``: the tensor
    cores' own accumulation when True). Row ``i`` of A pairs the product ``16 * 16 = 2**8`` with
    ``2**-e * 2**-6`` (``e = i - 6``: ``2**(8 - r)``, ``r = 8 + i`` bits below it), in the same
    32-wide chunk of K (``within``) or in the next one (``across``). Returns ``{"within": [[r,
    kept], ...], "across": [...]}``, ``kept`` the share of the small product that reached the
    fp32 result (1.0 all of it, 0.0 none; fp32 itself holds it to ``r = 23``)."""
    rows, n, k = 16, 16, 64
    one = torch.ones((), device=device)
    res = {}
    for where, ks in (("within", 1), ("across", 32)):
        a = torch.zeros(rows, k)
        b = torch.zeros(k, n)
        a[:, 0], b[0, :] = 16.0, 16.0
        a[:, ks] = torch.tensor([2.0 ** -(i - 6) for i in range(rows)])
        b[ks, :] = 2.0 ** -6
        a8, b8 = a.to(E4M3), b.to(E4M3)
        # mat2 column-major, as the FP8 GEMM requires
        out = torch._scaled_mm(a8.to(device), b8.to(device).t().contiguous().t(), scale_a=one, scale_b=one,
                               out_dtype=torch.float32, use_fast_accum=fast_accum).cpu()
        big = a8.float()[:, 0] * b8.float()[0, 0]
        small = a8.float()[:, ks] * b8.float()[ks, 0]
        res[where] = [[8 + i, float((out[i, 0] - big[i]) / small[i])] for i in range(rows)]
    return res


def main(argv=None) -> int:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--length", type=int, default=1024, help="keys (a multiple of 64)")
    p.add_argument("--dists", default="normal,outliers,big_q,peaked")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated ways the FP8 dots sum (module doc)")
    p.add_argument("--bits", type=int, default=13, help="bits the tensor cores' adder keeps below its largest addend")
    p.add_argument("--probe", action="store_true", help="also measure this GPU's FP8 GEMM accumulation "
                   "(probe_accumulation; needs CUDA)")
    p.add_argument("--out", default=None, help="json path (default: print only)")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if a.heads < 1 or a.length < TILE or a.length % TILE or a.seeds < 1 or not modes or \
            not set(modes) <= set(MODES) or not 1 <= a.bits <= 23:
        raise SystemExit(f"--heads >= 1, --length a positive multiple of 64, --seeds >= 1, --modes of {MODES}, "
                         f"--bits in 1..23")
    spec = ModelSpec(num_heads=a.heads)
    rows = []
    for dist in filter(None, a.dists.split(",")):
        for seed in range(a.seeds):
            gen = torch.Generator().manual_seed(seed)
            try:
                q, packed = make_inputs(a.heads, a.length, dist, gen, spec)
            except ValueError as e:
                raise SystemExit(str(e))
            for mode in modes:
                outs = run_paths(q, packed, spec, mode, a.bits)
                r = {"dist": dist, "seed": seed, "mode": mode,
                     **{k: errors(outs[k], outs["reference"]) for k in ("shipped", "fp8_dots")}}
                rows.append(r)
                print(json.dumps(r), flush=True)
    worst = {}
    for r in rows:
        w = worst.setdefault(f"{r['dist']} {r['mode']}", {"shipped": 0.0, "fp8_dots": 0.0})
        for k in w:
            w[k] = max(w[k], r[k]["tol_ratio"])
    for k, w in worst.items():
        print(f"{k:>28}: worst |err| / tolerance shipped {w['shipped']:.3f}, fp8 dots {w['fp8_dots']:.3f}")
    res = {"heads": a.heads, "length": a.length, "seeds": a.seeds, "bits": a.bits, "tolerance_atol_rtol": BF16_TOL,
           "worst_tol_ratio": worst, "rows": rows}
    if a.probe:
        if not torch.cuda.is_available():
            raise SystemExit("--probe needs a CUDA GPU")
        res["probe"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "fast_accum": probe_accumulation(fast_accum=True),
                        "cublas_default": probe_accumulation(fast_accum=False)}
        for mode, pr in res["probe"].items():
            if isinstance(pr, dict):
                for where, kept in pr.items():
                    print(f"probe {mode} {where}: " + " ".join(f"r={r}:{x:.2f}" for r, x in kept))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
