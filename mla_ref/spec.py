"""Model dimensions for MLA (DeepSeek-style multi-head latent attention)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of one MLA layer.

    The attention op sees queries of width ``d_qk = kv_lora_rank + qk_rope_head_dim``
    against one shared latent KV row of the same width; values are the first
    ``kv_lora_rank`` dims (``d_v``). ``fp8_group`` is the number of latent values that
    share one fp32 scale in the FP8 cache layout (128 in FlashMLA).
    """

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_heads: int = 128
    q_lora_rank: int = 1536
    hidden: int = 7168
    fp8_group: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "num_heads", "q_lora_rank", "hidden", "fp8_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"ModelSpec.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.kv_lora_rank % self.fp8_group:
            raise ValueError(
                f"ModelSpec.kv_lora_rank ({self.kv_lora_rank}) must be a multiple of "
                f"fp8_group ({self.fp8_group}): each FP8 scale covers one whole group")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError("ModelSpec.rope_theta and rms_eps must be positive")

    @classmethod
    def deepseek_v3(cls) -> "ModelSpec":
        """DeepSeek-V3 / R1 attention dims (d_qk 576, 128 heads, 656-byte FP8 tokens)."""
        return cls()

    @classmethod
    def tiny(cls, num_heads: int = 8) -> "ModelSpec":
        """CPU-friendly dims with the same structure: rank 64 + rope 16, FP8 groups of 16
        (a 112-byte FP8 token: 16-byte aligned like DeepSeek's 656, see kernels.config)."""
        return cls(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                   num_heads=num_heads, q_lora_rank=48, hidden=64, fp8_group=16)

    @classmethod
    def from_name(cls, name: str) -> "ModelSpec":
        """``"tiny"`` or ``"deepseek-v3"``; ValueError naming the choices otherwise."""
        table = {"tiny": cls.tiny, "deepseek-v3": cls.deepseek_v3, "deepseek_v3": cls.deepseek_v3}
        if name not in table:
            raise ValueError(f"unknown spec {name!r}; known: tiny, deepseek-v3")
        return table[name]()

    @property
    def d_qk(self) -> int:
        """Width of a query/key row of the latent attention op (latent + rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def d_v(self) -> int:
        """Width of the latent attention output (the value part of the latent row)."""
        return self.kv_lora_rank

    @property
    def softmax_scale(self) -> float:
        """The model's scale: 1/sqrt(nope + rope), not 1/sqrt(d_qk) (absorption keeps it)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    @property
    def fp8_bytes_per_token(self) -> int:
        """FlashMLA's FP8 token: rank e4m3 bytes + one fp32 scale per group + bf16 rope."""
        return self.kv_lora_rank + 4 * (self.kv_lora_rank // self.fp8_group) + 2 * self.qk_rope_head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"ModelSpec: unknown fields {sorted(unknown)}")
        return cls(**d)
