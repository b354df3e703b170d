"""The user's narrowing of a backend's capabilities from the command line (``mla-fuzz run``,
``mla-fuzz mutants``, the pytest plugin): ``--kv-dtypes fp16,bf16 --next-n 1,2`` restricts
what is drawn without touching the backend's code."""
from __future__ import annotations

from mla_fuzz.mla_ref.capabilities import ALL_KV_DTYPES, ALL_NEXT_N, ALL_Q_DTYPES, MTP_MODES

#: flag -> (Capabilities field, parser, help)
FLAGS = {
    "--kv-dtypes": ("kv_dtypes", "list", f"draw only these KV formats ({','.join(ALL_KV_DTYPES)})"),
    "--q-dtypes": ("q_dtypes", "list", f"draw only these query dtypes ({','.join(ALL_Q_DTYPES)})"),
    "--next-n": ("next_n", "ints", f"draw only these query tokens per request ({','.join(map(str, ALL_NEXT_N))})"),
    "--mtp": ("mtp", "choice", f"MTP shape: {'|'.join(MTP_MODES)} (at most what the backend declares)"),
    "--page-sizes": ("page_sizes", "ints", "draw only these KV page sizes"),
    "--heads": ("heads", "ints", "draw only these query head counts"),
}
SWITCHES = {"--no-empty-rows": ("empty_rows", "real requests never have seq_len 0"),
            "--no-sparse": ("sparse", "no sparse top-k scenarios"),
            "--no-layer": ("layer", "no whole-layer scenarios")}


def add_arguments(group) -> None:
    """Add the narrowing flags to an argparse group."""
    for flag, (_field, _kind, text) in FLAGS.items():
        group.add_argument(flag, default=None, metavar="LIST" if _kind != "choice" else "MODE", help=text)
    for flag, (_field, text) in SWITCHES.items():
        group.add_argument(flag, action="store_true", help=text)


def parse(values: dict) -> dict:
    """``Capabilities.narrow`` keywords from ``{flag: text}`` (argparse's dest names or the
    flags themselves). ValueError with a one-line message naming the flag."""
    out = {}
    for flag, (field, kind, _text) in FLAGS.items():
        raw = values.get(flag, values.get(flag.lstrip("-").replace("-", "_")))
        if raw in (None, ""):
            continue
        items = [x.strip() for x in str(raw).split(",") if x.strip()]
        if kind == "choice":
            if raw not in MTP_MODES:
                raise ValueError(f"{flag}: expected one of {', '.join(MTP_MODES)}, got {raw!r}")
            out[field] = raw
            continue
        if not items:
            raise ValueError(f"{flag}: expected a comma-separated list, got {raw!r}")
        if kind == "ints":
            try:
                items = [int(x) for x in items]
            except ValueError:
                raise ValueError(f"{flag}: expected comma-separated integers, got {raw!r}") from None
            if any(x < 1 for x in items):
                raise ValueError(f"{flag}: expected positive integers, got {raw!r}")
            if field == "next_n" and any(x not in ALL_NEXT_N for x in items):
                raise ValueError(f"{flag}: the fuzzer draws next_n from {','.join(map(str, ALL_NEXT_N))}, got {raw!r}")
        else:
            allowed = ALL_KV_DTYPES if field == "kv_dtypes" else ALL_Q_DTYPES
            bad = [x for x in items if x not in allowed]
            if bad:
                raise ValueError(f"{flag}: unknown {', '.join(bad)}; known: {', '.join(allowed)}")
        out[field] = items
    for flag, (field, _text) in SWITCHES.items():
        if values.get(flag, values.get(flag.lstrip("-").replace("-", "_"))):
            out[field] = False
    return out
