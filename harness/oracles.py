"""Oracles: precise, cheap checks whose failure messages say where and by how much.

Messages follow ``torch.testing.assert_close``: how many elements mismatch, the
greatest absolute and relative difference and at which index, plus which batch rows
are affected — a global cosine would hide one bad row among many good ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Per-element tolerances of the backend's output against the fp32 reference, by query
# dtype: a bf16 result carries ~2^-8 relative rounding on O(1) values, fp16 ~2^-11;
# split-KV accumulation in fp32 adds much less than one output ulp.
OUT_TOL = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-4, 1e-4)}
# lse is fp32 in both, but the kernel's scores come from bf16/fp16 q·k products.
LSE_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


class OracleFailure(AssertionError):
    """An oracle fired. ``oracle`` names it; ``evidence`` holds what the diagnosis needs."""

    def __init__(self, oracle: str, message: str, step: int | None = None, evidence: dict | None = None):
        super().__init__(f"[{oracle}] {message}")
        self.oracle = oracle
        self.message = message
        self.step = step
        self.evidence = evidence or {}


@dataclass
class Mismatch:
    count: int
    total: int
    max_abs: float
    max_abs_at: tuple
    max_rel: float
    max_rel_at: tuple
    rows: list = field(default_factory=list)

    def describe(self, name: str, atol: float | None = None, rtol: float | None = None) -> str:
        allowed = "" if atol is None else f" (up to {atol:g} allowed)"
        rallowed = "" if rtol is None else f" (up to {rtol:g} allowed)"
        return (f"{name}: mismatched elements: {self.count} / {self.total} "
                f"({100.0 * self.count / max(self.total, 1):.1f}%); "
                f"greatest absolute difference: {self.max_abs:g} at index {self.max_abs_at}{allowed}; "
                f"greatest relative difference: {self.max_rel:g} at index {self.max_rel_at}{rallowed}; "
                f"batch rows affected: {self.rows}")


def _index(flat_idx: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_idx), tuple(shape)))


def compare_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Mismatch | None:
    """Elementwise ``|a - e| <= atol + rtol*|e|``; equal infinities and NaN-vs-NaN never
    pass silently: a NaN on either side is a mismatch. Dim 0 is the batch row."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise OracleFailure("shape", f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    bad = diff > atol + rtol * e.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    if not bool(bad.any()):
        return None
    rel = diff / e.abs().clamp_min(1e-12)
    ia = int(diff.argmax())
    ir = int(torch.where(bad, rel, torch.zeros_like(rel)).argmax())
    rows = sorted({int(r) for r in bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()}) if a.dim() else []
    return Mismatch(int(bad.sum()), bad.numel(), float(diff.reshape(-1)[ia]), _index(ia, a.shape),
                    float(rel.reshape(-1)[ir]), _index(ir, a.shape), rows)


def compare_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> Mismatch | None:
    """Bit-for-bit equality (NaN payloads included), reported like ``compare_close``."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise OracleFailure("shape", f"{tuple(actual.shape)}/{actual.dtype} vs {tuple(expected.shape)}/{expected.dtype}")
    ai = actual.detach().contiguous().view(torch.uint8).reshape(actual.shape + (-1,)).cpu()
    ei = expected.detach().contiguous().view(torch.uint8).reshape(expected.shape + (-1,)).cpu()
    bad = (ai != ei).any(dim=-1)
    if not bool(bad.any()):
        return None
    m = compare_close(actual, expected, 0.0, 0.0)
    if m is None:  # differs only in NaN payload or signed zero
        idx = _index(int(bad.reshape(-1).nonzero()[0]), actual.shape)
        rows = sorted({int(r) for r in bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()})
        return Mismatch(int(bad.sum()), bad.numel(), 0.0, idx, 0.0, idx, rows)
    m.count = int(bad.sum())
    return m


def nonfinite_rows(x: torch.Tensor) -> list[int]:
    """Batch rows (dim 0) holding NaN or inf."""
    bad = ~torch.isfinite(x.detach().float())
    return sorted({int(r) for r in bad.reshape(x.shape[0], -1).any(dim=1).nonzero().flatten().cpu()})


def check_out_lse(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                  what: str, step: int) -> None:
    """Eager-vs-reference oracle (2) for the attention op: out per element, lse per (row, head,
    token) — including the zero-length conventions (out 0, lse -inf) that the reference states."""
    atol, rtol = OUT_TOL.get(out.dtype, (1e-2, 1e-2))
    m = compare_close(out, ref_out, atol, rtol)
    if m is not None:
        raise OracleFailure("reference", m.describe(f"{what} out vs reference", atol, rtol), step,
                            {"rows": m.rows})
    ltol = LSE_TOL.get(out.dtype, 1e-2)
    m = compare_close(lse, ref_lse, ltol, ltol)
    if m is not None:
        raise OracleFailure("reference", m.describe(f"{what} lse vs reference", ltol, ltol), step,
                            {"rows": m.rows})


def check_layer(out: torch.Tensor, ref: torch.Tensor, what: str, step: int, fp8_out: bool) -> None:
    """Layer output vs reference. Tolerance scales with the output's magnitude: o_proj sums
    h*v_head_dim products, so absolute error grows with the row norm; per-tensor FP8 output
    quantisation adds up to one e4m3 step (2^-3 relative) on elements near a rounding edge."""
    scale = float(ref.detach().abs().float().max().clamp_min(1e-6))
    frac = 0.08 if fp8_out else 0.03
    m = compare_close(out, ref, frac * scale, frac)
    if m is not None:
        raise OracleFailure("reference", m.describe(f"{what} layer output vs reference", frac * scale, frac),
                            step, {"rows": m.rows})
