"""Scenario data: the configuration drawn once per scenario and the JSON step schema.

A scenario is ``ScenarioConfig`` + a list of step dicts. Steps are plain JSON so a
shrunk failure is a pasteable, replayable program (see ``harness.repro``):

- ``{"op": "eager", "batch": BatchDraw, "pad_to": int | null, "poison": bool}``
- ``{"op": "warmup", "size": S, "batch": BatchDraw}``   eager run padded to capture size S
- ``{"op": "capture", "size": S, "batch": BatchDraw}``  build + capture forward at size S
- ``{"op": "replay", "size": S, "batch": BatchDraw, "poison": bool}``  new batch, replay graph S

``BatchDraw`` = ``{"seed": int, "seq_lens": [int], "q_lens": [int], "max_decode_len": int}``,
plus ``"k_scale": float`` in ``fp8_e4m3`` scenarios (the KV scale during the step, one for
all its layers); ``seed`` fixes the page assignment, the query/hidden values and block-table
garbage, and in sparse scenarios (``config.sparse``) the ragged top-k selection
(``World.make_batch``). Every step runs ``config.layers`` attention layers on its one build
(docs/design.md, "A step: L layers on one build").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

STEP_OPS = ("eager", "warmup", "capture", "replay")
Q_DTYPES = ("bf16", "fp16")
#: the most attention layers one step runs (``ScenarioConfig.layers``)
MAX_LAYERS = 4


@dataclass
class ScenarioConfig:
    """Everything fixed for one scenario. ``spec`` is a ``ModelSpec.to_dict()``."""

    spec: dict
    kv_dtype: str = "bf16"
    q_dtype: str = "bf16"
    page_size: int = 16
    next_n: int = 1
    capture_sizes: list = field(default_factory=lambda: [1, 2, 4])
    max_pages_per_seq: int = 8
    layer: bool = False
    fp8_out: bool = False
    seed: int = 0
    # sparse top-k decode: each step carries a ragged selection of <= topk slots per token
    sparse: bool = False
    topk: int = 0
    # sparse only: the backend selects the top-k on the device (its indexer) instead of the
    # engine handing over a ragged selection
    indexer: bool = False
    # Pages in the KV pool, the null block included. Requests of a step share the pool, as in
    # an engine, so a long row does not cost ``max_batch`` long rows of memory. ``None``: the
    # pool of older repro files, sized for every row at full length (their pages replay as
    # recorded).
    pool_pages: int | None = None
    # Attention layers a step's forward runs on ONE build (metadata), as an engine's decoder
    # stack does: each layer its own KV cache and queries (the layer path: its own weights,
    # its input the previous layer's output), all captured in one graph, every layer's output
    # kept until the step ends. Older repro files have none: 1.
    layers: int = 1
    # The layer path's weights are drawn from this seed (``strategies.WEIGHT_SEEDS`` values:
    # a worker draws each set once, ``World``), not from ``seed``: at DeepSeek-V3 size a set is
    # 187M Gaussian draws, about 1.8 s of a worker's CPU for every layer scenario. ``None``
    # (older repro files): ``seed``, so they replay the weights they recorded.
    weights_seed: int | None = None

    @property
    def max_batch(self) -> int:
        return max(self.capture_sizes)

    @property
    def num_blocks(self) -> int:
        """Pages in the KV pool (page 0 is the null block)."""
        if self.pool_pages is not None:
            return self.pool_pages
        return 1 + self.max_batch * self.max_pages_per_seq + 3

    @property
    def path(self) -> str:
        """The data path: ``attention``, ``layer``, ``layer+fp8_out`` or ``sparse`` (with the
        device indexer: ``sparse+indexer``)."""
        if self.sparse:
            return "sparse+indexer" if self.indexer else "sparse"
        return ("layer+fp8_out" if self.fp8_out else "layer") if self.layer else "attention"

    @property
    def max_seq_len(self) -> int:
        return self.page_size * self.max_pages_per_seq

    def validate(self) -> None:
        from mla_fuzz.mla_ref import KV_DTYPES, ModelSpec

        if isinstance(self.spec, str):  # a spec by name, as the CLI takes it
            self.spec = ModelSpec.from_name(self.spec).to_dict()
        if not isinstance(self.spec, dict):
            raise ValueError(f"config.spec must be a spec name (tiny, deepseek-v3) or a dict of ModelSpec fields, "
                             f"got {type(self.spec).__name__}")
        ModelSpec.from_dict(self.spec)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"config.kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.q_dtype not in Q_DTYPES:
            raise ValueError(f"config.q_dtype must be one of {Q_DTYPES}, got {self.q_dtype!r}")
        if not self.capture_sizes or any(int(s) < 1 for s in self.capture_sizes):
            raise ValueError(f"config.capture_sizes must be positive ints, got {self.capture_sizes}")
        if not 1 <= self.next_n <= 8:
            raise ValueError(f"config.next_n must be in [1, 8], got {self.next_n}")
        if self.fp8_out and not self.layer:
            raise ValueError("config.fp8_out needs config.layer (it quantises the layer's attention output)")
        if self.sparse and (not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"config.topk must be a positive int when config.sparse, got {self.topk!r}")
        if self.indexer and not self.sparse:
            raise ValueError("config.indexer needs config.sparse")
        if self.pool_pages is not None and (not isinstance(self.pool_pages, int) or self.pool_pages < 2):
            raise ValueError(f"config.pool_pages must be an int >= 2 (the null block and one page), "
                             f"got {self.pool_pages!r}")
        if not isinstance(self.max_pages_per_seq, int) or self.max_pages_per_seq < 1:
            raise ValueError(f"config.max_pages_per_seq must be a positive int, got {self.max_pages_per_seq!r}")
        if self.sparse and self.layer:
            raise ValueError("config.sparse scenarios drive the attention op only (config.layer must be False)")
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or not 1 <= self.layers <= MAX_LAYERS:
            raise ValueError(f"config.layers must be an int in [1, {MAX_LAYERS}], got {self.layers!r}")
        if self.weights_seed is not None and (not isinstance(self.weights_seed, int)
                                              or isinstance(self.weights_seed, bool) or self.weights_seed < 0):
            raise ValueError(f"config.weights_seed must be a non-negative int or null, got {self.weights_seed!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ScenarioConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"config: unknown fields {sorted(unknown)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg


#: Coverage keys that hold a maximum, not counts: ``{"longest": {"16384": 1}}`` is the
#: longest sequence drawn (one entry, whatever was merged into it).
MAX_KEYS = frozenset({"longest"})


def add_note(cov: dict, key: str, value: str, amount: int = 1) -> None:
    """Add one coverage note to ``cov`` (key -> {value: count}); for ``MAX_KEYS`` the single
    value kept is the largest seen."""
    if key in MAX_KEYS:
        old = next(iter(cov.get(key) or {}), None)
        if old is None or int(value) > int(old):
            cov[key] = {value: 1}
        return
    d = cov.setdefault(key, {})
    d[value] = d.get(value, 0) + int(amount)


def withdraw_notes(cov: dict, notes) -> None:
    """Take back notes ``(key, value)`` that ``add_note`` counted once each (a scenario the
    backend declined is not a searched example); ``MAX_KEYS`` stay (the largest seen)."""
    for key, value in notes:
        d = cov.get(key)
        if key in MAX_KEYS or not d or value not in d:
            continue
        d[value] -= 1
        if d[value] <= 0:
            del d[value]
        if not d:
            del cov[key]


def spec_family(spec: dict) -> str:
    """``tiny`` (any head count), ``deepseek-v3`` or ``custom``: how coverage names a spec."""
    from mla_fuzz.mla_ref import ModelSpec
    s = ModelSpec.from_dict(spec)
    if s == ModelSpec.deepseek_v3():
        return "deepseek-v3"
    return "tiny" if s == ModelSpec.tiny(num_heads=s.num_heads) else "custom"


def scenario_coverage(cfg: ScenarioConfig) -> list[tuple[str, str]]:
    """The coverage notes (dimension, value) a new scenario adds."""
    from mla_fuzz.mla_ref import ModelSpec
    notes = [(k, str(getattr(cfg, k))) for k in ("kv_dtype", "next_n", "page_size", "path", "layers")]
    return notes + [("heads", str(ModelSpec.from_dict(cfg.spec).num_heads)), ("spec", spec_family(cfg.spec))]


def step_coverage(cfg: ScenarioConfig, step: dict) -> list[tuple[str, str]]:
    """The coverage notes a step adds: its op, MTP short decode, padded rows, empty rows, its
    longest row (``MAX_KEYS``)."""
    b = step["batch"]
    notes = [("op", step["op"])]
    if b.get("max_decode_len", cfg.next_n) < cfg.next_n:
        notes.append(("mtp", "max_decode_len<next_n"))
    if len(b["seq_lens"]) < (step.get("size") or step.get("pad_to") or 0):
        notes.append(("padding", "padded rows"))
    if 0 in b["seq_lens"]:
        notes.append(("seq_len", "0"))
    if b["seq_lens"]:
        notes.append(("longest", str(max(b["seq_lens"]))))
    return notes


def validate_step(step: dict, cfg: ScenarioConfig) -> None:
    """ValueError for a malformed step (used when loading repro files)."""
    if not isinstance(step, dict) or step.get("op") not in STEP_OPS:
        raise ValueError(f"step must be a dict with op in {STEP_OPS}, got {step!r}")
    batch = step.get("batch")
    if not isinstance(batch, dict) or not {"seed", "seq_lens", "q_lens"} <= set(batch):
        raise ValueError(f"step {step['op']!r}: 'batch' must have seed, seq_lens, q_lens; got {batch!r}")
    if len(batch["seq_lens"]) != len(batch["q_lens"]):
        raise ValueError(f"step {step['op']!r}: seq_lens and q_lens differ in length")
    for name in ("seq_lens", "q_lens"):
        bad = [v for v in batch[name] if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        if bad:
            raise ValueError(f"step {step['op']!r}: batch.{name} must hold integers >= 0, got {bad[0]!r}")
    over = [i for i, (s_, q_) in enumerate(zip(batch["seq_lens"], batch["q_lens"])) if q_ > s_]
    if over:
        i = over[0]
        raise ValueError(f"step {step['op']!r}: batch.q_lens[{i}] = {batch['q_lens'][i]} exceeds "
                         f"batch.seq_lens[{i}] = {batch['seq_lens'][i]} (a request's query tokens are among its keys)")
    ks = batch.get("k_scale")
    if ks is not None and (cfg.kv_dtype != "fp8_e4m3" or isinstance(ks, bool) or not isinstance(ks, (int, float))
                           or not 0 < ks < float("inf")):
        raise ValueError(f"step {step['op']!r}: batch.k_scale must be a positive number and only in fp8_e4m3 "
                         f"scenarios (kv_dtype here {cfg.kv_dtype!r}), got {ks!r}")
    mdl = batch.get("max_decode_len")
    if mdl is not None and (not isinstance(mdl, int) or not 0 <= mdl <= cfg.next_n
                            or any(q_ > mdl for q_ in batch["q_lens"])):
        raise ValueError(f"step {step['op']!r}: batch.max_decode_len must be in [max(q_lens), next_n={cfg.next_n}], "
                         f"got {mdl!r}")
    if any(s > cfg.max_seq_len for s in batch["seq_lens"]):
        raise ValueError(f"step {step['op']!r}: a seq_len exceeds max_seq_len {cfg.max_seq_len}")
    pages = sum(-(-s // cfg.page_size) for s in batch["seq_lens"])
    if pages > cfg.num_blocks - 1:
        raise ValueError(f"step {step['op']!r}: the batch needs {pages} pages of {cfg.page_size} tokens but the "
                         f"KV pool has {cfg.num_blocks - 1} (config.pool_pages, the null block apart)")
    size = step.get("size", step.get("pad_to"))
    if step["op"] != "eager" and size not in cfg.capture_sizes:
        raise ValueError(f"step {step['op']!r}: size {size} is not a capture size {cfg.capture_sizes}")
    if size is not None and len(batch["seq_lens"]) > size:
        raise ValueError(f"step {step['op']!r}: batch of {len(batch['seq_lens'])} exceeds size {size}")


def outside_capabilities(cfg: ScenarioConfig, steps: list[dict], caps) -> str | None:
    """Why a scenario lies outside a backend's ``mla_ref.Capabilities`` (None when inside):
    what the fuzzer would never draw for it, so a fixed scenario (the property suite's) does
    not apply."""
    from mla_fuzz.mla_ref import ModelSpec

    checks = [(cfg.kv_dtype not in caps.kv_dtypes, f"KV cache {cfg.kv_dtype}"),
              (cfg.q_dtype not in caps.q_dtypes, f"queries in {cfg.q_dtype}"),
              (cfg.next_n not in caps.next_n, f"next_n {cfg.next_n}"),
              (caps.page_sizes is not None and cfg.page_size not in caps.page_sizes, f"page size {cfg.page_size}"),
              (caps.heads is not None and ModelSpec.from_dict(cfg.spec).num_heads not in caps.heads, "head count"),
              (cfg.layer and not caps.layer, "layer steps"), (cfg.sparse and not caps.sparse, "sparse batches")]
    for step in steps:
        b = step["batch"]
        real = [(s, q) for s, q in zip(b["seq_lens"], b["q_lens"])]
        mdl = b.get("max_decode_len") or max([q for _, q in real] + [0])
        checks += [
            (not caps.empty_rows and any(s == 0 or q == 0 for s, q in real), "a request with seq_len 0"),
            (caps.max_seq_len is not None and any(s > caps.max_seq_len for s, _ in real),
             f"sequences over {caps.max_seq_len} tokens"),
            (caps.mtp != "ragged" and (mdl != cfg.next_n or any(q not in (0, cfg.next_n) for _, q in real)),
             f"query lengths other than next_n (mtp={caps.mtp!r})"),
        ]
    for bad, what in checks:
        if bad:
            return f"{what}: outside the backend's capabilities"
    return None
