"""The decode kernels compile once for every batch of one model, dtype and launch config.

Triton specialises each integer argument into a class (equal to 1, a multiple of 16, neither)
and compiles a variant per combination. The block table's row stride and the tokens per
request follow the batch, so a campaign that varies the batch met dozens of variants after its
warmup (benchmarks/results/h200-2026-11-29-compiles-after-warmup.json); the kernels therefore
leave them unspecialised (``kernels.config.UNSPECIALIZED_DECODE_INTEGERS``). Here every class of
both, at one config, must reuse the first variant, and every output must match the reference.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from mla_fuzz import kernels, mla_ref
from mla_fuzz.kernels import default_config
from mla_fuzz.mla_ref import ModelSpec
from kernels_cases import TOL_GPU, assert_decode_close, make_case

# one of Triton's three integer classes each: 1, a multiple of 16, neither
_WIDTHS = (1, 16, 5)
_TOKENS = (1, 2, 3)


def _with_width(block_table: torch.Tensor, width: int) -> torch.Tensor:
    """The same rows in a contiguous table ``width`` pages wide (extra columns: the null page 0)."""
    used = block_table[:, :width]
    pad = torch.zeros(block_table.shape[0], width - used.shape[1], dtype=block_table.dtype,
                      device=block_table.device)
    return torch.cat([used, pad], dim=1).contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("size,kernel_name", [("tiny", "_decode_split_kernel"), ("deepseek-v3", None)])
def test_batch_integers_reuse_one_compiled_decode_gpu(size, kernel_name, monkeypatch):
    from triton.runtime.jit import JITFunction

    spec = ModelSpec.tiny() if size == "tiny" else ModelSpec(num_heads=128)
    page = 64
    # one launch config for every case: the constexprs stay the same, only the integers change
    cfg = default_config(spec, 1, torch.device("cuda"), batch=4)
    compiled = Counter()
    original = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled[getattr(self, "__name__", "?")] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)
    for s_q in _TOKENS:
        # every request fits one page, so a table one page wide holds it
        case = make_case(spec, seq_lens=[40, 1, 64, 17], q_lens=[s_q, 1, s_q, min(2, s_q)], s_q=s_q, page_size=page,
                         kv_dtype="bf16", seed=s_q, device="cuda")
        ref = mla_ref.mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, spec=spec,
                                 q_lens=case.q_lens)
        for width in _WIDTHS:
            out, lse = kernels.mla_decode(case.q, case.kv_cache, _with_width(case.block_table, width), case.seq_lens,
                                          spec=spec, q_lens=case.q_lens, config=cfg)
            assert_decode_close(out, lse, *ref, tol=TOL_GPU[case.q.dtype], what=f"{size} s_q={s_q} width={width}")
    decodes = {name: n for name, n in compiled.items() if name.startswith("_decode_")}
    if kernel_name is not None:
        assert set(decodes) <= {kernel_name}, decodes
    # a kernel an earlier test of this process compiled is not compiled again: at most one each
    assert all(n == 1 for n in decodes.values()), (
        f"{size}: the decode compiled per class of the block table's width or of the tokens per request: {decodes}")
