"""The simulated engine around a backend: KV pool, page allocation, inputs, poisoning.

Block 0 of the pool is the *null block* that padded rows point at (as in vLLM); the
fuzzer may fill it, the pages a step does not use, and padded input rows with NaN
(``0xFF`` bytes: NaN in bf16, fp16, fp32 and e4m3 alike) so any read of padding shows.
Every value is drawn from a seeded ``torch.Generator``: same seed, same bytes.

An ``fp8_e4m3`` cache is read as ``e4m3 * k_scale`` with one scale for the layer, which the
engine owns as a device tensor and writes in place: the world keeps one such tensor
(``World.k_scale``) and sets it to each step's drawn ``k_scale`` (1.0 when the draw has none)
before the backend builds, so a graph that froze the capture-time scale reads a stale one.
Every layer of the step reads it (``DecodeBatch`` carries one scale per build): one scale is
shared by the step's layers, where an engine has one per layer.

Layers (``ScenarioConfig.layers``): the KV caches of a step's layers are views of one pool
allocation, ``kv_pool [layers, num_blocks, page_size, ...]`` (layer ``l``'s cache is
``kv_pool[l]``, as TensorRT-LLM's pool with per-layer offsets; the page ids are the same for
every layer). Layer 0 is drawn exactly as a single-layer world is (older repro files replay
the same bytes); layer ``l > 0`` gets its own cache contents and queries from seeds derived
with ``layer_seed``, and in the layer path its own weights: layer 0's matrices with their rows
rotated by a seeded amount (a copy, where fresh Gaussian weights cost seconds a layer at
DeepSeek-V3 size). Layer 0's weights are drawn from ``cfg.weights_seed`` (one of a few sets,
each drawn once per process, ``layer_weights``; older repro files: the scenario seed). The
device indexer's weights are shared (the backend takes one set).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import DecodeBatch, ModelSpec

from .scenario import ScenarioConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POISON_BYTE = 0xFF


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def layer_seed(seed: int, layer: int) -> int:
    """The seed of layer ``layer``'s data drawn from ``seed``: ``seed`` itself for layer 0 (a
    single-layer world is unchanged), a different one for every other layer."""
    return int(seed) if layer == 0 else (int(seed) * 1_000_003 + 7_919 * int(layer)) & 0x7FFF_FFFF_FFFF_FFFF


def rotated_weights(w: "mla_ref.MLALayerWeights", seed: int) -> "mla_ref.MLALayerWeights":
    """Another layer's weights made from ``w`` cheaply: every tensor's rows rotated by an
    amount drawn from ``seed`` (never 0)."""
    g = _gen(seed)
    out = {}
    for name, t in vars(w).items():
        n = t.shape[0]
        shift = int(torch.randint(1, n, (1,), generator=g)) if n > 1 else 0
        out[name] = t.roll(shift, 0)
    return type(w)(**out)


#: (spec, seed, dtype) -> the layer weights drawn for them, in host memory, most recently used last
_WEIGHTS: "OrderedDict[tuple, mla_ref.MLALayerWeights]" = OrderedDict()
#: weight sets a process keeps (at DeepSeek-V3 size 375 MB each in bf16), in host memory: a
#: worker's GPU memory between scenarios is its neighbours'
WEIGHTS_KEPT = 2


def layer_weights(spec: ModelSpec, seed: int, dtype: torch.dtype, device: torch.device) -> "mla_ref.MLALayerWeights":
    """``mla_ref.MLALayerWeights.random(spec, seed, dtype, device)``, each set drawn once per
    process (``WEIGHTS_KEPT`` kept, on the host): a copy of it on ``device``, so a backend that
    writes into its weights changes no other scenario's."""
    key = (repr(spec), int(seed), dtype)
    w = _WEIGHTS.pop(key, None)
    if w is None:
        w = mla_ref.MLALayerWeights.random(spec, seed, dtype=dtype, device="cpu")
    _WEIGHTS[key] = w
    while len(_WEIGHTS) > WEIGHTS_KEPT:
        _WEIGHTS.popitem(last=False)
    device = torch.device(device)
    return type(w)(**{name: t.clone() if device.type == "cpu" else t.to(device) for name, t in vars(w).items()})


class World:
    """KV pool, weights and input buffers for one scenario on one device."""

    def __init__(self, cfg: ScenarioConfig, device: torch.device | str):
        self.cfg = cfg
        self.device = torch.device(device)
        self.spec = ModelSpec.from_dict(cfg.spec)
        self.q_dtype = DTYPES[cfg.q_dtype]
        # One pool shared by the step's requests (ScenarioConfig.num_blocks), with slack so
        # page assignment is a real permutation, not the identity.
        self.num_blocks = cfg.num_blocks
        self.layers = cfg.layers
        one = mla_ref.make_kv_cache(self.spec, self.num_blocks, cfg.page_size, cfg.kv_dtype, self.device)
        # every layer's cache: a view of one allocation (see the module doc)
        self.kv_pool = torch.empty((self.layers,) + tuple(one.shape), dtype=one.dtype, device=self.device)
        del one
        self.kv_caches = [self.kv_pool[i] for i in range(self.layers)]
        self.kv_cache = self.kv_caches[0]
        # the engine's per-layer scale tensor (fp8_e4m3 only): one tensor, written in place
        self.k_scale = (torch.ones(1, dtype=torch.float32, device=self.device)
                        if cfg.kv_dtype == "fp8_e4m3" else None)
        # every layer's clean contents (``clean``: layer 0's, as before layers existed)
        self.clean_pool = torch.stack([self._random_cache(layer_seed(cfg.seed, i)) for i in range(self.layers)])
        self.clean = self.clean_pool[0]
        self.kv_pool.copy_(self.clean_pool)
        self.layer_weights = None
        if cfg.layer:
            w0 = layer_weights(self.spec, cfg.seed if cfg.weights_seed is None else cfg.weights_seed,
                               self.q_dtype, self.device)
            self.layer_weights = [w0] + [rotated_weights(w0, layer_seed(cfg.seed, i)) for i in range(1, self.layers)]
        self.weights = None if self.layer_weights is None else self.layer_weights[0]
        self.indexer = (mla_ref.IndexerWeights.random(self.spec, cfg.seed, device=self.device)
                        if cfg.sparse and cfg.indexer else None)

    # -- cache ---------------------------------------------------------------------------
    def _random_cache(self, seed: int) -> torch.Tensor:
        spec, ps = self.spec, self.cfg.page_size
        g = _gen(seed * 7919 + 1)
        n = self.num_blocks * ps
        latent = torch.randn(n, spec.kv_lora_rank, generator=g)
        rope = torch.randn(n, spec.qk_rope_head_dim, generator=g)
        if self.cfg.kv_dtype == "fp8":
            packed = mla_ref.quantize_kv_fp8(latent, rope, spec=spec)
            return packed.reshape(self.num_blocks, ps, -1).to(self.device)
        if self.cfg.kv_dtype == "fp8_e4m3":
            # stored at scale 1: every step's scale then reads the same bytes as other values
            rows = mla_ref.quantize_kv_fp8_e4m3(latent, rope, 1.0)
            return rows.reshape(self.num_blocks, ps, 1, spec.d_qk).to(self.device)
        full = torch.cat([latent, rope], dim=-1).to(DTYPES[self.cfg.kv_dtype])
        return full.reshape(self.num_blocks, ps, 1, spec.d_qk).to(self.device)

    def reset_cache(self, poison: bool, used_pages: set[int] | None = None) -> None:
        """Restore every layer's clean contents in place (the graph holds these tensors);
        optionally NaN every page outside ``used_pages`` — the null block included — in every
        layer's cache."""
        self.kv_pool.copy_(self.clean_pool)
        if poison:
            unused = torch.ones(self.num_blocks, dtype=torch.bool)
            if used_pages:
                unused[torch.tensor(sorted(used_pages), dtype=torch.int64)] = False
            if bool(unused.any()):
                raw = self.kv_pool.view(torch.uint8)
                raw[:, unused.to(self.device)] = POISON_BYTE

    # -- batches -------------------------------------------------------------------------
    def make_batch(self, draw: dict, pad_to: int | None) -> DecodeBatch:
        """A ``DecodeBatch`` from a ``BatchDraw`` (scenario.py): pages scattered at random."""
        cfg = self.cfg
        ps, mp = cfg.page_size, cfg.max_pages_per_seq
        seq_lens = [int(s) for s in draw["seq_lens"]]
        q_lens = [int(q) for q in draw["q_lens"]]
        B = len(seq_lens)
        g = _gen(draw["seed"])
        perm = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()
        # Unused block-table columns hold valid-but-wrong page ids: a kernel that reads
        # past a row's last page gets plausible garbage, which the reference exposes.
        table = torch.randint(1, self.num_blocks, (B, mp), generator=g, dtype=torch.int32)
        slots = torch.full((B, cfg.next_n), -1, dtype=torch.int64)
        for b in range(B):
            need = -(-seq_lens[b] // ps)
            pages = [perm.pop() for _ in range(need)]
            table[b, :need] = torch.tensor(pages, dtype=torch.int32) if pages else table[b, :0]
            for i in range(q_lens[b]):
                pos = seq_lens[b] - q_lens[b] + i
                slots[b, i] = pages[pos // ps] * ps + pos % ps
        sparse: dict = {}  # and the fp8_e4m3 scale
        if self.k_scale is not None:
            self.k_scale.fill_(float(draw.get("k_scale", 1.0)))
            sparse["k_scale"] = self.k_scale
        if cfg.sparse and cfg.indexer:
            sparse.update(topk=cfg.topk)  # the backend's indexer selects on the device
        elif cfg.sparse:
            flat, indptr = self.topk_selection(draw, seq_lens, q_lens, table)
            sparse.update(topk_flat=flat, topk_indptr=indptr, topk=cfg.topk)
        return DecodeBatch(
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            q_lens=torch.tensor(q_lens, dtype=torch.int32),
            block_table=table, slot_mapping=slots, page_size=ps, next_n=cfg.next_n,
            max_decode_len=int(draw.get("max_decode_len") or max(q_lens + [0])),
            pad_to=pad_to, kv_dtype=cfg.kv_dtype, null_block=0, **sparse)

    def topk_selection(self, draw: dict, seq_lens: list, q_lens: list,
                       table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A ragged top-k selection, as an engine's indexer hands it over: int32
        ``(flat [nnz], indptr [B*next_n + 1])``.

        Real token i of request b may pick among its visible keys (``seq_len - q_len + i + 1``,
        bottom-right causal), each at most once; a row holds ``k`` distinct visible slots
        (``k`` anywhere in ``[0, min(topk, visible)]``: topk > seq_len just selects everything)
        padded with -1 up to a random length ``<= topk``, in random order — so rows of only
        -1, empty rows and an nnz that shrinks and grows from step to step all occur.
        Padding tokens get empty rows. Drawn from its own generator, so dense draws are
        unchanged by it.
        """
        cfg = self.cfg
        ps, n, topk = cfg.page_size, cfg.next_n, cfg.topk
        g = _gen(int(draw["seed"]) * 131 + 17)
        flat: list[int] = []
        indptr = [0]
        for b, (L, ql) in enumerate(zip(seq_lens, q_lens)):
            for i in range(n):
                if i < ql:
                    visible = L - ql + i + 1
                    k = int(torch.randint(0, min(topk, visible) + 1, (1,), generator=g))
                    pos = torch.randperm(visible, generator=g)[:k].tolist()
                    row = [int(table[b, p // ps]) * ps + p % ps for p in pos]
                    row += [-1] * int(torch.randint(0, topk - k + 1, (1,), generator=g))
                    order = torch.randperm(len(row), generator=g).tolist()
                    flat.extend(row[j] for j in order)
                indptr.append(len(flat))
        return torch.tensor(flat, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32)

    @staticmethod
    def used_pages(batch: DecodeBatch) -> set[int]:
        used = set()
        for b in range(batch.batch_size):
            need = -(-int(batch.seq_lens[b]) // batch.page_size)
            used.update(int(p) for p in batch.block_table[b, :need])
        return used

    # -- inputs --------------------------------------------------------------------------
    def fill_q(self, q: torch.Tensor, draw: dict, B: int, poison: bool, layer: int = 0) -> None:
        """Write the step's queries of layer ``layer`` into rows ``[:B]`` of ``q [pad, s_q, h,
        d_qk]`` in place; padded rows become NaN when poisoning, else keep whatever they held
        (stale, as in a real engine's persistent input buffer)."""
        g = _gen(layer_seed(draw["seed"], layer) * 31 + 7)
        real = torch.randn((B,) + tuple(q.shape[1:]), generator=g).to(q.dtype)
        q[:B].copy_(real)
        if poison and q.shape[0] > B:
            q[B:].view(torch.uint8).fill_(POISON_BYTE) if q.dtype.itemsize == 1 else q[B:].fill_(float("nan"))

    def fill_hidden(self, hidden: torch.Tensor, positions: torch.Tensor, batch: DecodeBatch,
                    draw: dict, poison: bool) -> None:
        """Layer inputs: hidden ``[pad, s_q, hidden]`` and positions int64 ``[pad, s_q]``
        (position of token i = seq_len - q_len + i; padding tokens 0)."""
        B = batch.batch_size
        g = _gen(draw["seed"] * 31 + 11)
        hidden[:B].copy_(torch.randn((B,) + tuple(hidden.shape[1:]), generator=g).to(hidden.dtype))
        if poison and hidden.shape[0] > B:
            hidden[B:].fill_(float("nan"))
        positions.zero_()
        positions[:B].copy_(token_positions(batch).to(positions.device))

    def new_q(self, pad: int) -> torch.Tensor:
        s = self.spec
        return torch.zeros(pad, self.cfg.next_n, s.num_heads, s.d_qk, dtype=self.q_dtype, device=self.device)

    def new_hidden(self, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.zeros(pad, self.cfg.next_n, self.spec.hidden, dtype=self.q_dtype, device=self.device)
        p = torch.zeros(pad, self.cfg.next_n, dtype=torch.int64, device=self.device)
        return h, p


def token_positions(batch: DecodeBatch) -> torch.Tensor:
    """int64 ``[B, next_n]``: position of query token i of request b; padding tokens get 0."""
    i = torch.arange(batch.next_n).unsqueeze(0)
    start = (batch.seq_lens - batch.q_lens).to(torch.int64).unsqueeze(1)
    pos = start + i
    return torch.where(i < batch.q_lens.unsqueeze(1), pos, torch.zeros_like(pos))
