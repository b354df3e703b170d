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


@dataclass(frozen=True)
class Oracle:
    """One oracle: its name (as findings and repros give it), what it checks, when it runs
    (for people), and the executor phases that run it (``"build"``: after a replay's build;
    ``"eager"``/``"replay"``: after an eager step's / a replay's forwards; empty: built into
    every forward or capture)."""

    name: str
    checks: str
    when: str
    phases: tuple = ()


#: Every oracle, once. The executor runs the phased ones in this order; the docs and the
#: README render this table (``oracle_table``; ``tests`` check they match).
ORACLES = (
    Oracle("contract", "forward's out/lse: shape, dtype and device as the contract and capabilities say",
           "every forward"),
    Oracle("backend-error", "the backend's code raised (the first error of a capture, unwrapped), at its file:line",
           "every step"),
    Oracle("bounds", "every load and store of an interpreted kernel stays inside the tensors of its launch, "
           "at the kernel's file:line", "every step, TRITON_INTERPRET=1 only"),
    Oracle("host-sync", "no host read or sync while a graph is captured", "capture"),
    Oracle("custom-op", "every kernel launch is recordable under emulation (a dispatched op)", "emulated capture"),
    Oracle("contiguity", "no non-contiguous view of the builder's metadata reaches a kernel (strict: any tensor)",
           "every forward"),
    Oracle("address", "every tensor the captured graph reads (through a kernel or a plain torch op) that the metadata or the backend object holds keeps its address across builds",
           "each replay's build (graph modes)", ("build",)),
    Oracle("integrity", "KV slots no real token of the step writes are bitwise unchanged", "eager steps, replays",
           ("eager", "replay")),
    Oracle("determinism", "an eager forward run twice gives the same bits", "eager steps", ("eager",)),
    Oracle("finite", "no NaN or inf in real rows", "eager steps, replays", ("eager", "replay")),
    Oracle("replay-eager", "replay equals an eager forward of the same batch, bit for bit (at the dtype tolerance "
           "when the backend declares schedule_may_differ)", "replays", ("replay",)),
    Oracle("reference", "eager (and a tolerance-compared replay) against mla_ref per element, out and lse",
           "eager steps, replays", ("eager", "replay")),
)

_TABLE_BEGIN, _TABLE_END = "<!-- oracles:begin -->", "<!-- oracles:end -->"


def oracle_table() -> str:
    """``ORACLES`` as a Markdown table."""
    rows = ["| oracle | checks | when |", "| --- | --- | --- |"]
    rows += [f"| `{o.name}` | {o.checks} | {o.when} |" for o in ORACLES]
    return "\n".join(rows)


def render_into(text: str) -> str:
    """``text`` with the table between its ``<!-- oracles:begin/end -->`` markers replaced."""
    a, b = text.index(_TABLE_BEGIN) + len(_TABLE_BEGIN), text.index(_TABLE_END)
    return text[:a] + "\n" + oracle_table() + "\n" + text[b:]


class OracleFailure(AssertionError):
    """An oracle fired. ``oracle`` names it; ``evidence`` holds what the diagnosis needs."""

    def __init__(self, oracle: str, message: str, step: int | None = None, evidence: dict | None = None):
        super().__init__(f"[{oracle}] {message}")
        self.oracle = oracle
        self.message = message
        self.step = step
        self.evidence = evidence or {}


def failure_key(f: OracleFailure) -> str:
    """What makes two failures different before any diagnosis: the oracle, and for a backend
    error the exception type and the backend's file:line, for a contract violation the field.
    Findings are deduplicated by it (with the diagnosis class), so one frequent error cannot
    hide another."""
    ev = f.evidence or {}
    if f.oracle in ("backend-error", "host-sync", "custom-op") and (ev.get("exc_type") or ev.get("site")):
        return f"{f.oracle}:{ev.get('exc_type', '?')}@{ev.get('site') or '?'}"
    if f.oracle == "contract" and ev.get("field"):
        return f"contract:{ev['field']}"
    return f.oracle


def failure_dict(f: OracleFailure) -> dict:
    """The JSON form kept in reports and repros: oracle, step, message, key, and for an
    exception where it was raised and its traceback."""
    d = {"oracle": f.oracle, "step": f.step, "message": f.message, "key": failure_key(f)}
    ev = f.evidence or {}
    for k in ("site", "traceback"):
        if ev.get(k):
            d[k] = ev[k]
    return d


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


#: The worst ``|a - e| / (atol + rtol*|e|)`` of the tolerance comparisons since the last
#: ``take_closeness()``: how near a passing comparison came to failing (the search steers
#: towards larger values with ``hypothesis.target``).
_closeness = [0.0]


def take_closeness() -> float:
    """The worst closeness ratio seen since the last call (0.0 when none), and reset it."""
    worst, _closeness[0] = _closeness[0], 0.0
    return worst


def compare_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Mismatch | None:
    """Elementwise ``|a - e| <= atol + rtol*|e|``; equal infinities and NaN-vs-NaN never
    pass silently: a NaN on either side is a mismatch. Dim 0 is the batch row. A passing
    comparison notes its worst ratio to the tolerance (``take_closeness``)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise OracleFailure("shape", f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    tol = atol + rtol * e.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    bad = diff > tol
    if not bool(bad.any()):
        if diff.numel() and (atol > 0 or rtol > 0):
            _closeness[0] = max(_closeness[0], float((diff / tol.clamp_min(1e-30)).max()))
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
    ai, ei = _bytes(actual), _bytes(expected)
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 ``[*t.shape, itemsize]`` of any strided ``t``, through a fresh dense copy:
    ``contiguous()`` is a no-op where only size-1 dims have odd strides (an lse of shape
    [pad, h, 1] written through a strided view), and ``view(uint8)`` then refuses it."""
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t.detach())
    return dense.view(torch.uint8).reshape(tuple(t.shape) + (t.element_size(),)).cpu()


def replay_tolerances(name: str, dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for replay vs eager of a backend whose graph may run another schedule:
    the reference tolerances of the tensor's dtype (``name`` "out" or "lse")."""
    if name == "lse":
        t = LSE_TOL.get(dtype, 1e-2)
        return t, t
    return OUT_TOL.get(dtype, (1e-2, 1e-2))


_CONTRACT = "the DecodeBackend contract, docs/backends.md#forward"


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return f"a {type(x).__name__}" if x is not None else "None"


def _check_tensor(field: str, t, shape: tuple, dtype: torch.dtype, device: torch.device, step, why: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise OracleFailure("contract", f"forward returned {field} as {_describe(t)}; expected a tensor of shape "
                            f"{list(shape)} ({_CONTRACT})", step, {"field": field})
    for what, got, want in (("shape", list(t.shape), list(shape)), ("dtype", t.dtype, dtype),
                            ("device", t.device, device)):
        if got != want:
            extra = why if what == "dtype" else ""
            raise OracleFailure("contract", f"forward returned {field} with {what} {got}, expected {want}{extra} "
                                f"({_CONTRACT})", step, {"field": f"{field}.{what}"})


def check_contract(got, q: torch.Tensor, spec, caps, step) -> tuple:
    """Oracle 0, checked before any other: ``forward``'s return value. ``(out, lse)`` (``out``
    alone or ``(out, None)`` when ``caps.lse`` is None): ``out [pad, s_q, h, kv_lora_rank]``
    in q's dtype, ``lse [pad, h, s_q]`` in fp32 (or q's dtype with ``caps.lse_dtype == "q"``),
    both on q's device; any strides. Returns ``(out, lse)``; ``OracleFailure("contract")``
    naming the field, what was expected and what came."""
    if isinstance(got, torch.Tensor):
        out, lse = got, None
    elif isinstance(got, (tuple, list)) and len(got) in (1, 2):
        out, lse = got[0], (got[1] if len(got) == 2 else None)
    else:
        raise OracleFailure("contract", f"forward returned {_describe(got)}"
                            + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else "")
                            + f"; expected (out, lse) ({_CONTRACT})", step, {"field": "return"})
    pad, s_q, h = q.shape[:3]
    dev = q.device
    _check_tensor("out", out, (pad, s_q, h, spec.kv_lora_rank), q.dtype, dev, step, " (q's dtype)")
    if caps.lse is None:
        return out, None
    if lse is None:
        raise OracleFailure("contract", f"forward returned no lse, but the backend's capabilities declare "
                            f"lse={caps.lse!r}; declare Capabilities(lse=None) if it has none ({_CONTRACT})",
                            step, {"field": "lse"})
    want = torch.float32 if caps.lse_dtype == "fp32" else q.dtype
    why = " (capabilities.lse_dtype='fp32'; declare lse_dtype='q' for lse in q's dtype)" if caps.lse_dtype == "fp32" \
        else " (capabilities.lse_dtype='q': q's dtype)"
    _check_tensor("lse", lse, (pad, h, s_q), want, dev, step, why)
    return out, lse


def nonfinite_rows(x: torch.Tensor) -> list[int]:
    """Batch rows (dim 0) holding NaN or inf."""
    bad = ~torch.isfinite(x.detach().float())
    return sorted({int(r) for r in bad.reshape(x.shape[0], -1).any(dim=1).nonzero().flatten().cpu()})


def check_out_lse(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                  what: str, step: int) -> None:
    """Eager-vs-reference oracle (2) for the attention op: out per element, lse per (row, head,
    token) — including the zero-length conventions (out 0, lse -inf) that the reference states.
    ``lse`` None: the backend has none (``Capabilities(lse=None)``); out alone is checked."""
    atol, rtol = OUT_TOL.get(out.dtype, (1e-2, 1e-2))
    m = compare_close(out, ref_out, atol, rtol)
    if m is not None:
        raise OracleFailure("reference", m.describe(f"{what} out vs reference", atol, rtol), step,
                            {"rows": m.rows})
    if lse is None:  # the backend declares no lse
        return
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


def main(argv=None) -> int:
    """``python -m mla_fuzz.harness.oracles FILE...``: re-render the oracle table in each file."""
    import sys
    from pathlib import Path
    for name in (sys.argv[1:] if argv is None else argv):
        path = Path(name)
        path.write_text(render_into(path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
