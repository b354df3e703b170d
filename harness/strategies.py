"""Hypothesis strategies: scenario configurations and batch draws.

Edge values are weighted in on purpose: seq_len 0 and 1, page boundaries (ps-1, ps,
ps+1), full length; scenario lengths from 32 tokens up to the campaign's ``max_seq_len``
(long rows beside short ones in one pool, captures of short batches replayed with long
ones: where split paths and their frozen plans live); next_n 1-4 with max_decode_len <
next_n (the non-contiguous MTP view, vLLM #42135); heads not a multiple of the kernel's head block; batches smaller
than the capture size (padding); both FP8 caches (FlashMLA's token, and e4m3 with a per-layer
scale that changes between steps) and per-tensor FP8 layer output; sparse top-k
scenarios (ragged selections, topk both below and above the sequence lengths); steps of one to
three attention layers on one build (``LAYERS``).
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from mla_fuzz.mla_ref import Capabilities, ModelSpec

from .scenario import ScenarioConfig

_ALL = Capabilities()

TINY_HEADS = (1, 3, 4, 8, 16)
# top-k widths of sparse scenarios: 1, non-multiples of the CPU tile (16), and 64 (the
# interpreter is slow: the tiny spec keeps topk <= 64); DeepSeek size uses 2048
TOPK_TINY = (1, 5, 16, 33, 64)
CAPTURE_POOL = (1, 2, 3, 4, 8)
FP8_FORMATS = ("fp8", "fp8_e4m3")
# the fp8_e4m3 layer scale of a step: 1 first (what shrinking goes to), powers of two either
# side (exact, so a wrong scale is the only difference) and an inexact one
K_SCALES = (1.0, 0.5, 2.0, 0.125, 4.0, 0.3)
_K_SCALE = st.sampled_from(K_SCALES)
#: The layer path's weight sets (``ScenarioConfig.weights_seed`` = the scenario seed modulo
#: this): the weights shape the projections' values, not the graph lifecycle, so a few sets
#: serve the search, and each worker draws each set once.
WEIGHT_SEEDS = 2
# Rows up to this long never compete for the KV pool: a scenario of short rows gets a pool
# for all of them at full length, a long one a pool of two full-length rows (engines share
# one pool between requests too).
SHORT_ROW = 512
# the shortest scenario length drawn, and how many lengths up to the campaign's bound
MIN_SCENARIO_LEN = 32
SCENARIO_LENGTHS = 6


#: Attention layers a step runs on one build (``ScenarioConfig.layers``): one in two scenarios
#: runs several; from ``LONG_LAYERS_FROM`` tokens at most two (a cache and its copies per
#: layer: at DeepSeek-V3 size a 32768-token pool is about 77 MB a layer, kept four times).
LAYERS = (1, 1, 2, 3)
LAYERS_LONG = (1, 1, 2)
LONG_LAYERS_FROM = 8192
_LAYERS = st.sampled_from(LAYERS)
_LAYERS_LONG = st.sampled_from(LAYERS_LONG)


#: The data paths a scenario takes (``ScenarioConfig.path``'s values): the attention op alone,
#: the whole layer (cache write, projections), the layer with per-tensor FP8 output, sparse.
PATHS = ("attention", "layer", "layer+fp8_out", "sparse")


def pool_for(max_batch: int, max_seq_len: int, page_size: int) -> int:
    """Pages of a scenario's KV pool (null block included): a token budget of
    ``max(2 * max_seq_len, max_batch * min(max_seq_len, SHORT_ROW))`` shared by the step's
    rows, plus one page per row for partly filled last pages, one per row for rows raised to
    their shortest legal length, the null block and three pages of slack."""
    tokens = max(2 * max_seq_len, max_batch * min(max_seq_len, SHORT_ROW))
    return -(-tokens // page_size) + 2 * max_batch + 4


def token_budget(cfg: ScenarioConfig) -> int:
    """Tokens all rows of one step may hold together (``pool_for``'s budget; a legacy config
    without ``pool_pages`` has room for every row at full length)."""
    if cfg.pool_pages is None:
        return cfg.max_batch * cfg.max_seq_len
    return (cfg.pool_pages - 2 * cfg.max_batch - 4) * cfg.page_size


def scenario_lengths(max_seq_len: int) -> tuple:
    """The scenario lengths drawn (each equally often): ``SCENARIO_LENGTHS`` steps spaced
    geometrically from ``MIN_SCENARIO_LEN`` to ``max_seq_len``, so a long bound adds long
    scenarios without thinning out the short ones (512: 32, 56, 97, 169, 294, 512; 32768: 32,
    128, 512, 2048, 8192, 32768)."""
    if max_seq_len <= MIN_SCENARIO_LEN:
        return (max_seq_len,)
    ratio = (max_seq_len / MIN_SCENARIO_LEN) ** (1 / (SCENARIO_LENGTHS - 1))
    steps = [round(MIN_SCENARIO_LEN * ratio ** i) for i in range(SCENARIO_LENGTHS - 1)]
    return tuple(sorted(set(steps) | {max_seq_len}))


@st.composite
def configs(draw, base: ModelSpec, *, layer_ok: bool = True, vary_heads: bool = True,
            max_seq_len: int = 512, page_sizes=(4, 16, 64), sparse_ok: bool = False,
            caps: Capabilities = _ALL, path: str | None = None, book: bool = False) -> ScenarioConfig:
    """A ``ScenarioConfig`` around ``base`` (heads varied for small specs), drawn inside the
    backend's ``caps``: sequences up to a drawn length of at most ``max_seq_len`` tokens
    (``scenario_lengths``), in a KV pool of ``pool_for`` pages. ``sparse_ok``: the backend
    takes sparse batches, so a scenario may be sparse (then attention-only). The data path is
    one of ``PATHS`` that the backend takes, each equally likely (Hypothesis draws them in
    runs Hypothesis draws them in: the search rotates ``path``, given, through them). ``book``:
    for the opening book (``harness.book``): the simplest draw is the hardest shape instead of
    the smallest (the longest scenario length, the largest next_n, two capture sizes; not the
    layer count, drawn last from ``LAYERS``, so a failure of one layer shrinks to one)."""
    spec = base
    heads = TINY_HEADS if vary_heads and base.num_heads <= 16 else (base.num_heads,)
    if caps.heads is not None:
        heads = tuple(h for h in heads if h in caps.heads) or caps.heads
    if heads != (base.num_heads,):
        spec = ModelSpec(**{**base.to_dict(), "num_heads": draw(st.sampled_from(heads))})
    # kv first; a 16-bit cache is read with queries of its own dtype, FP8 with bf16 when allowed
    kv_choices = [k for k in ("bf16", "fp8", "fp16", "fp8_e4m3")
                  if k in caps.kv_dtypes and (k in FP8_FORMATS or k in caps.q_dtypes)]
    kv_dtype = draw(st.sampled_from(kv_choices))
    q_dtype = kv_dtype if kv_dtype not in FP8_FORMATS else ("bf16" if "bf16" in caps.q_dtypes else "fp16")
    sizes = sorted(draw(st.sets(st.sampled_from(CAPTURE_POOL), min_size=2 if book else 1, max_size=3)))
    # the data path, one of those the backend takes, each equally often: a sparse draw that
    # overrode the layer turned the FP8-output layer (the only path by which padding garbage
    # reaches real rows through the batch-wide amax) into one scenario in 30
    path = draw(_paths(layer_ok, sparse_ok)) if path is None else path
    layer, fp8_out = path in ("layer", "layer+fp8_out"), path == "layer+fp8_out"
    if caps.page_sizes is not None:
        page_sizes = tuple(p for p in page_sizes if p in caps.page_sizes) or caps.page_sizes
    page_size = draw(st.sampled_from(page_sizes))
    top = max_seq_len if caps.max_seq_len is None else min(max_seq_len, caps.max_seq_len)
    length = draw(_lengths(max(1, top), book))
    # whole pages within the drawn length: rows never exceed --max-seq-len (a length below
    # one page still gets the page)
    pages = max(1, length // page_size)
    if caps.max_seq_len is not None:
        pages = max(1, min(pages, caps.max_seq_len // page_size))
    cfg = ScenarioConfig(
        spec=spec.to_dict(), kv_dtype=kv_dtype, q_dtype=q_dtype, page_size=page_size,
        next_n=draw(st.sampled_from(caps.next_n[::-1] if book else caps.next_n)), capture_sizes=sizes,
        max_pages_per_seq=pages, layer=layer, fp8_out=fp8_out, seed=draw(st.integers(0, 2**20)),
        pool_pages=pool_for(max(sizes), pages * page_size, page_size))
    cfg.weights_seed = cfg.seed % WEIGHT_SEEDS
    if path == "sparse":
        cfg.sparse = True
        cfg.topk = draw(st.sampled_from(TOPK_TINY if base.num_heads <= 16 else (64, 2048)))
        # the ragged (engine-selected) path carries most bug classes: 2 in 3
        cfg.indexer = draw(st.sampled_from((False, False, True)))
    # attention layers per step, on one build (the last draw: a scenario of one layer shrinks
    # to what it was before layers existed); fewer for long scenarios (each layer its own cache)
    cfg.layers = draw(_LAYERS_LONG if length >= LONG_LAYERS_FROM else _LAYERS)
    return cfg


def paths_allowed(layer_ok: bool, sparse_ok: bool) -> tuple:
    """The ``PATHS`` a backend takes (layer steps, sparse batches)."""
    return tuple(p for p in PATHS if (layer_ok or not p.startswith("layer")) and (sparse_ok or p != "sparse"))


@functools.lru_cache(maxsize=None)
def _paths(layer_ok: bool, sparse_ok: bool) -> st.SearchStrategy:
    return st.sampled_from(paths_allowed(layer_ok, sparse_ok))


@functools.lru_cache(maxsize=None)
def _lengths(top: int, longest_first: bool = False) -> st.SearchStrategy:
    lengths = scenario_lengths(top)
    return st.sampled_from(lengths[::-1] if longest_first else lengths)


@functools.lru_cache(maxsize=None)
def _seq_len_strategy(ps: int, top: int) -> st.SearchStrategy:
    edge = [0, 1, ps - 1, ps, ps + 1, top - 1, top]
    # short rows beside long ones in one batch, whatever the scenario's length
    return st.one_of(st.sampled_from([e for e in edge if 0 <= e <= top]), st.integers(0, top),
                     st.integers(0, min(top, 4 * ps)))


# Strategies are immutable: built once per bound and reused, because a fresh strategy
# object is re-validated by Hypothesis on every draw — about 15% of a GPU fuzz step when
# every row drew through a new one.
_int = functools.lru_cache(maxsize=None)(st.integers)
_SEED = st.integers(0, 2**31 - 1)


def seq_len_values(cfg: ScenarioConfig, top: int | None = None) -> st.SearchStrategy:
    """A request's seq_len: edges (0, 1, page boundaries, full length), short, or any in
    range (``top``: a bound below the scenario's ``max_seq_len``)."""
    return _seq_len_strategy(cfg.page_size, cfg.max_seq_len if top is None else min(top, cfg.max_seq_len))


def short_bound(cfg: ScenarioConfig) -> int:
    """The longest row of a *short* batch (a capture that later replays see longer than):
    an eighth of the scenario's length, at least one page."""
    return max(cfg.page_size, cfg.max_seq_len // 8)


@functools.lru_cache(maxsize=None)
def _long_strategy(lo: int, top: int) -> st.SearchStrategy:
    # shrinks towards the longest row, not the shortest
    return st.integers(0, max(0, top - lo)).map(lambda d: top - d)


@st.composite
def batch_draws(draw, cfg: ScenarioConfig, max_rows: int, min_rows: int = 1, allow_empty_rows: bool = True,
                caps: Capabilities = _ALL, top: int | None = None, long: bool = False,
                max_decode_len: int | None = None) -> dict:
    """A ``BatchDraw`` (scenario.py) with 1..max_rows requests, inside ``caps``: with
    ``mtp="uniform"`` every real request has ``next_n`` query tokens, with ``"none"`` one;
    without ``empty_rows`` no real request has seq_len 0. Rows are at most ``top`` tokens
    (default: the scenario's length) and share the pool's ``token_budget``: a row drawn
    longer than what is left is cut to it. ``long``: rows drawn from the upper half of the
    range (at most an equal share of the pool each), the longest first (the opening book's
    "replay longer"); ``max_decode_len``: fixed
    instead of drawn (ragged MTP only)."""
    B = draw(_int(min_rows, max_rows))
    ragged = caps.mtp == "ragged"
    mdl = (max_decode_len if max_decode_len is not None else draw(_int(1, cfg.next_n))) if ragged else cfg.next_n
    empty_ok = allow_empty_rows and caps.empty_rows
    bound = cfg.max_seq_len if top is None else min(top, cfg.max_seq_len)
    if long:  # every row real: each as long as an equal share of the pool allows
        bound = max(1, min(bound, token_budget(cfg) // B))
    lens = _long_strategy(bound // 2, bound) if long else seq_len_values(cfg, top)
    floor = 1 if ragged else mdl  # shortest sequence that holds the step's query tokens
    left = token_budget(cfg)
    seq_lens, q_lens = [], []
    for _ in range(B):
        s = min(draw(lens), max(left, 0))
        if s == 0 and not empty_ok:
            s = 1
        if 0 < s < floor:
            s = min(floor, cfg.max_seq_len)
        left -= s
        q = 0 if s == 0 else (draw(_int(1, min(mdl, s))) if ragged else min(mdl, s))
        seq_lens.append(s)
        q_lens.append(q)
    out = {"seed": draw(_SEED), "seq_lens": seq_lens, "q_lens": q_lens, "max_decode_len": mdl}
    if cfg.kv_dtype == "fp8_e4m3":
        out["k_scale"] = draw(_K_SCALE)
    return out
