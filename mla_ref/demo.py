"""``python -m mla_fuzz.mla_ref.demo``: naive vs absorbed layer decode on one random batch.

Builds a random MTP decode batch (ragged seq lens, mixed q lens, shuffled physical pages,
a prefilled latent cache), runs both layer forms on identical copies of the cache and
prints the per-request max error. Exit status 1 if any request exceeds the dtype tolerance.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import torch

from .cache import make_kv_cache, write_kv_cache
from .layer import MLALayerWeights, mla_layer_decode_absorbed, mla_layer_decode_naive
from .spec import ModelSpec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
# max |naive - absorbed| relative to the output's max magnitude; the absorbed form rounds
# q_latent and the latent output to the activation dtype where the naive one does not.
_TOLERANCE = {"bf16": 3e-2, "fp16": 4e-3, "fp32": 1e-5, "fp64": 1e-12}


def build_demo_batch(spec: ModelSpec, *, batch: int, max_seq_len: int, next_n: int, page_size: int,
                     kv_dtype: str, act_dtype: torch.dtype, seed: int) -> dict:
    """A random decode step with its cache history already written.

    Returns a dict with ``hidden [B, next_n, hidden]``, ``positions``/``slot_mapping`` int64
    ``[B, next_n]``, ``kv_cache``, ``block_table`` int32 ``[B, max_pages]``, ``cache_seqlens``
    and ``q_lens`` int32 ``[B]``.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, max_seq_len + 1, (batch,), generator=gen)
    q_lens = torch.minimum(torch.randint(1, next_n + 1, (batch,), generator=gen), seq_lens)
    pages = [-(-int(L) // page_size) for L in seq_lens]
    max_pages = max(pages)
    num_blocks = sum(pages) + 1
    # physical pages handed out in a random order, so logical and physical order differ
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(batch, max_pages, dtype=torch.int32)
    for b, n in enumerate(pages):
        block_table[b, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)

    def slot(b: int, t: int) -> int:
        return int(block_table[b, t // page_size]) * page_size + t % page_size

    kv_cache = make_kv_cache(spec, num_blocks, page_size, kv_dtype)
    history = [slot(b, t) for b in range(batch) for t in range(int(seq_lens[b]) - int(q_lens[b]))]
    if history:
        write_kv_cache(kv_cache, torch.randn(len(history), spec.kv_lora_rank, generator=gen),
                       torch.randn(len(history), spec.qk_rope_head_dim, generator=gen),
                       torch.tensor(history, dtype=torch.int64), spec=spec)
    slot_mapping = torch.full((batch, next_n), -1, dtype=torch.int64)
    positions = torch.zeros(batch, next_n, dtype=torch.int64)
    for b in range(batch):
        L, ql = int(seq_lens[b]), int(q_lens[b])
        for i in range(ql):
            slot_mapping[b, i] = slot(b, L - ql + i)
            positions[b, i] = L - ql + i
    hidden = torch.randn(batch, next_n, spec.hidden, generator=gen).to(act_dtype)
    return dict(hidden=hidden, positions=positions, slot_mapping=slot_mapping, kv_cache=kv_cache,
                block_table=block_table, cache_seqlens=seq_lens.to(torch.int32), q_lens=q_lens.to(torch.int32))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m mla_fuzz.mla_ref.demo", description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="deepseek-v3", help="'tiny' or 'deepseek-v3' (default)")
    p.add_argument("--heads", type=int, default=None, help="override the spec's num_heads")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--next-n", type=int, default=2, help="MTP query tokens per request")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="activation/weight dtype")
    p.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp32", "fp8"), default="bf16")
    p.add_argument("--fp8-out", action="store_true", help="per-tensor FP8 attention output before o_proj")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch", "max_seq_len", "next_n", "page_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")

    spec = ModelSpec.from_name(args.spec)
    if args.heads is not None:
        spec = ModelSpec(**{**spec.to_dict(), "num_heads": args.heads})
    act = _DTYPES[args.dtype]
    t0 = time.perf_counter()
    weights = MLALayerWeights.random(spec, seed=args.seed, dtype=act)
    case = build_demo_batch(spec, batch=args.batch, max_seq_len=args.max_seq_len, next_n=args.next_n,
                            page_size=args.page_size, kv_dtype=args.kv_dtype, act_dtype=act, seed=args.seed + 1)
    common = dict(positions=case["positions"], block_table=case["block_table"],
                  cache_seqlens=case["cache_seqlens"], slot_mapping=case["slot_mapping"])
    t1 = time.perf_counter()
    absorbed = mla_layer_decode_absorbed(weights, case["hidden"], kv_cache=case["kv_cache"].clone(), spec=spec,
                                         q_lens=case["q_lens"], fp8_out=args.fp8_out, **common)
    t2 = time.perf_counter()
    naive = mla_layer_decode_naive(weights, case["hidden"], kv_cache=case["kv_cache"].clone(), spec=spec,
                                   q_lens=case["q_lens"], fp8_out=args.fp8_out, **common)
    t3 = time.perf_counter()

    print(f"spec {args.spec} (h={spec.num_heads}, d_qk={spec.d_qk}, hidden={spec.hidden}), dtype {args.dtype}, "
          f"kv {args.kv_dtype}, fp8_out={args.fp8_out}, next_n={args.next_n}, page_size={args.page_size}")
    print(f"setup {t1 - t0:.2f}s  absorbed {t2 - t1:.2f}s  naive {t3 - t2:.2f}s")
    print(f"{'row':>4} {'seq_len':>8} {'q_len':>6} {'max|naive-absorbed|':>20} {'max|naive|':>11} {'rel':>10}")
    tol = _TOLERANCE[args.dtype]
    worst = 0.0
    for b in range(args.batch):
        diff = (naive[b].double() - absorbed[b].double()).abs().max().item()
        mag = naive[b].double().abs().max().item()
        rel = diff / max(mag, 1e-30)
        worst = max(worst, rel if diff == diff else float("inf"))
        print(f"{b:>4} {int(case['cache_seqlens'][b]):>8} {int(case['q_lens'][b]):>6} {diff:>20.3e} "
              f"{mag:>11.3e} {rel:>10.2e}")
    ok = worst <= tol
    print(f"worst relative error {worst:.2e} (tolerance {tol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
