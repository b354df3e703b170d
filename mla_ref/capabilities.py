"""What a decode backend supports, declared once so the fuzzer draws only inside it.

A backend sets ``capabilities = Capabilities(...)`` as a class attribute; a backend without
one supports everything the fuzzer can draw (``Capabilities()``). Inputs outside the
declaration are never drawn; an input inside it that the backend still cannot handle may
raise ``Unsupported``, which is counted, never reported as a bug.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

#: Every KV-cache format the fuzzer knows (``"fp8"``: FlashMLA's 656-byte token; ``"fp8_e4m3"``:
#: 576 e4m3 values a token and one per-layer fp32 scale tensor, ``DecodeBatch.k_scale``).
ALL_KV_DTYPES = ("bf16", "fp16", "fp8", "fp8_e4m3")
#: What a backend that declares no ``kv_dtypes`` is assumed to read: every format but
#: ``"fp8_e4m3"``, which a backend must opt into (it has to read ``DecodeBatch.k_scale``; one
#: written before the format existed would fail on it, not decline it).
DEFAULT_KV_DTYPES = ("bf16", "fp16", "fp8")
ALL_Q_DTYPES = ("bf16", "fp16")
#: The query tokens per request the fuzzer draws (1 = plain decode, more = MTP).
ALL_NEXT_N = (1, 2, 3, 4)
MTP_MODES = ("none", "uniform", "ragged")
LSE_MODES = ("natural", "base2", None)
LSE_DTYPES = ("fp32", "q")


class Unsupported(NotImplementedError):
    """Raised by a backend (constructor, ``build``, ``build_for_capture``, ``forward`` or
    ``write_kv``) for an input outside what it handles. The fuzzer counts it with its message
    as the reason and moves on; it is never a finding. A plain ``NotImplementedError`` is
    counted the same way (with a hint to declare ``capabilities`` instead)."""


def _tuple(name: str, value, allowed: tuple) -> tuple:
    if isinstance(value, (str, int)):
        value = (value,)
    try:
        value = tuple(value)
    except TypeError:
        raise ValueError(f"Capabilities.{name}: expected a tuple of values from {allowed}, got {value!r}") from None
    bad = [v for v in value if v not in allowed]
    if bad or not value:
        raise ValueError(f"Capabilities.{name}: expected a non-empty tuple of values from {allowed}, got {value!r}")
    return value


@dataclass(frozen=True)
class Capabilities:
    """A backend's declaration of the inputs it handles and the conventions it follows.

    - ``kv_dtypes``: KV-cache formats, from ``ALL_KV_DTYPES``: ``"bf16"``, ``"fp16"``, ``"fp8"``
      (FlashMLA's 656-byte token: 512 e4m3 + 4 fp32 group scales + 64 bf16 rope at DeepSeek
      size) and ``"fp8_e4m3"`` (576 e4m3 values a token, latent and rope, and one per-layer
      fp32 scale tensor, ``DecodeBatch.k_scale``). Default ``DEFAULT_KV_DTYPES``: all but
      ``"fp8_e4m3"``, which is opt-in.
    - ``q_dtypes``: query (and output) dtypes, from ``("bf16", "fp16")``; a bf16/fp16 cache is
      read with queries of the same dtype, an FP8 cache (either) with any of these.
    - ``next_n``: allowed query tokens per request (``s_q``), from 1-4.
    - ``mtp``: ``"none"`` one query token per real request (``next_n`` must be ``(1,)``);
      ``"uniform"`` every real request has exactly ``next_n`` query tokens
      (``max_decode_len == next_n``); ``"ragged"`` ``q_lens`` may differ within a batch and
      ``max_decode_len`` may be below ``next_n`` (the non-contiguous-view case, vLLM #42135).
    - ``page_sizes``: allowed KV page sizes (tokens per block); ``None`` = any the fuzzer draws.
    - ``empty_rows``: may a *real* request have ``seq_len == 0`` / ``q_len == 0``? (Padded rows
      always have them; they are the engine's, not the request's.)
    - ``lse``: ``"natural"`` (ln-sum-exp of the scaled scores), ``"base2"`` (log2, as
      FlashInfer returns it; converted before comparing) or ``None`` (no lse: ``forward``
      returns ``out`` or ``(out, None)``; the lse checks are skipped).
    - ``lse_dtype``: ``"fp32"``, or ``"q"`` for lse in the query's dtype (compared at that
      dtype's tolerance).
    - ``sparse``: takes top-k sparse batches (``DecodeBatch.topk*``).
    - ``layer``: may be driven by whole-layer steps (needs ``write_kv``).
    - ``max_seq_len``: the longest sequence it handles (``None``: no limit of its own).
    - ``heads``: allowed query head counts (``None``: any).
    - ``schedule_may_differ``: the graph may use another valid schedule than an eager call of
      the same batch (a split count chosen on the host at capture and frozen into the graph,
      as engines' Triton MLA backends do by design). Replay vs eager is then compared at the
      dtype tolerance instead of bit for bit; both are still held to the reference.
    """

    kv_dtypes: tuple = DEFAULT_KV_DTYPES
    q_dtypes: tuple = ALL_Q_DTYPES
    next_n: tuple = ALL_NEXT_N
    mtp: str = "ragged"
    page_sizes: Optional[tuple] = None
    empty_rows: bool = True
    lse: Optional[str] = "natural"
    lse_dtype: str = "fp32"
    sparse: bool = True
    layer: bool = True
    max_seq_len: Optional[int] = None
    heads: Optional[tuple] = None
    schedule_may_differ: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "kv_dtypes", _tuple("kv_dtypes", self.kv_dtypes, ALL_KV_DTYPES))
        set_(self, "q_dtypes", _tuple("q_dtypes", self.q_dtypes, ALL_Q_DTYPES))
        set_(self, "next_n", tuple(sorted(_tuple("next_n", self.next_n, ALL_NEXT_N))))
        if self.mtp not in MTP_MODES:
            raise ValueError(f"Capabilities.mtp: expected one of {MTP_MODES}, got {self.mtp!r}")
        if self.mtp == "none" and self.next_n != (1,):
            raise ValueError(f"Capabilities: mtp='none' means one query token per request, so next_n must be "
                             f"(1,), got {self.next_n}")
        if self.page_sizes is not None:
            ps = self.page_sizes if not isinstance(self.page_sizes, int) else (self.page_sizes,)
            if not ps or any(not isinstance(p, int) or p < 1 for p in ps):
                raise ValueError(f"Capabilities.page_sizes: expected positive ints or None, got {self.page_sizes!r}")
            set_(self, "page_sizes", tuple(sorted(ps)))
        if self.lse not in LSE_MODES:
            raise ValueError(f"Capabilities.lse: expected one of {LSE_MODES}, got {self.lse!r}")
        if self.lse_dtype not in LSE_DTYPES:
            raise ValueError(f"Capabilities.lse_dtype: expected one of {LSE_DTYPES}, got {self.lse_dtype!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"Capabilities.max_seq_len: expected a positive int or None, got {self.max_seq_len!r}")
        if self.heads is not None:
            h = self.heads if not isinstance(self.heads, int) else (self.heads,)
            if not h or any(not isinstance(x, int) or x < 1 for x in h):
                raise ValueError(f"Capabilities.heads: expected positive ints or None, got {self.heads!r}")
            set_(self, "heads", tuple(sorted(h)))
        for name in ("empty_rows", "sparse", "layer", "schedule_may_differ"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Capabilities.{name}: expected True or False, got {getattr(self, name)!r}")

    def narrow(self, **limits) -> "Capabilities":
        """The intersection with ``limits`` (same field names; ``None`` values ignored).
        ValueError naming the field when nothing is left, e.g. asking for fp8 of a backend
        that declares only bf16."""
        out = {}
        for name, want in limits.items():
            if want is None:
                continue
            if name not in {f.name for f in fields(self)}:
                raise ValueError(f"Capabilities: no field {name!r}")
            have = getattr(self, name)
            if name in ("kv_dtypes", "q_dtypes", "next_n", "page_sizes", "heads"):
                want = tuple(want) if not isinstance(want, (str, int)) else (want,)
                kept = tuple(v for v in want if have is None or v in have)
                if not kept:
                    raise ValueError(f"{name.replace('_', '-')} {','.join(map(str, want))}: the backend supports "
                                     f"{','.join(map(str, have))} only")
                out[name] = kept
            elif name == "max_seq_len":
                out[name] = want if have is None else min(have, want)
            elif name == "mtp":
                order = MTP_MODES.index
                if order(want) > order(have):
                    raise ValueError(f"mtp {want}: the backend supports mtp={have} only")
                out[name] = want
                if want == "none":
                    out["next_n"] = (1,)
            elif name in ("empty_rows", "sparse", "layer"):
                out[name] = have and bool(want)
            else:
                raise ValueError(f"Capabilities: {name!r} is a convention of the backend, not a limit to narrow")
        return replace(self, **out)

    def to_dict(self) -> dict:
        """JSON-ready (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Capabilities":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"Capabilities: unknown fields {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def describe(self) -> str:
        """One line for a person: what will be drawn and which conventions are assumed."""
        parts = [f"kv {','.join(self.kv_dtypes)}", f"q {','.join(self.q_dtypes)}",
                 f"next_n {','.join(map(str, self.next_n))} (mtp {self.mtp})",
                 f"pages {','.join(map(str, self.page_sizes)) if self.page_sizes else 'any'}",
                 f"empty rows {'yes' if self.empty_rows else 'no'}",
                 f"lse {self.lse or 'none'}" + (f" in {self.lse_dtype}" if self.lse else ""),
                 f"sparse {'yes' if self.sparse else 'no'}", f"layer {'yes' if self.layer else 'no'}"]
        if self.max_seq_len:
            parts.append(f"max seq {self.max_seq_len}")
        if self.heads:
            parts.append(f"heads {','.join(map(str, self.heads))}")
        if self.schedule_may_differ:
            parts.append("replay vs eager at tolerance (schedule may differ)")
        return "; ".join(parts)


def capabilities_of(backend_cls) -> Capabilities:
    """The backend's declared ``capabilities`` (a ``Capabilities``, or a dict of its fields),
    or ``Capabilities()`` when it declares none. ValueError on anything else."""
    caps = getattr(backend_cls, "capabilities", None)
    if caps is None:
        return Capabilities()
    if isinstance(caps, Capabilities):
        return caps
    if isinstance(caps, dict):
        return Capabilities.from_dict(caps)
    raise ValueError(f"{getattr(backend_cls, '__name__', backend_cls)}.capabilities must be an "
                     f"mla_fuzz.mla_ref.Capabilities, got {type(caps).__name__}")
