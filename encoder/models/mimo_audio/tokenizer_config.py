"""AudioTokenizerConfig: the frozen MiMo audio tokenizer's encoder, from ``audio_tokenizer/config.json``.

Only the encoder half is read (the file also describes the decoder and vocoder, which encoding never
runs). A key the file leaves out takes the default of the tokenizer's own config class (as the
reference code reads it), not the released value: e.g. ``avg_pooler`` 1 (no downsample) and
``encoder_attn_window_size`` [-1, -1] (no window).

Attention pattern: with ``hybrid_attention``, layer i is windowed when ``i % swa_per_block <
swa_per_block - 1`` and full otherwise (so with 2 per block: even layers windowed, odd full);
without it every layer takes ``encoder_attn_window_size``. A window is (left, right) in
flash-attention's sense: key j is visible to query i when ``i - left <= j <= i + right`` (-1: no
limit on that side); ``encoder_causal`` also hides every j > i.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

NO_WINDOW = (-1, -1)

# Keys of the file that say nothing about the encoder's forward (decoder, vocoder, features, HF).
_IGNORED_PREFIXES = ("decoder_", "vocoder_")
_IGNORED = frozenset(
    {
        "max_audio_seconds",  # sizes a position table the RoPE never needs
        "scale_embedding",  # the reference computes embed_scale and never applies it
        "use_istft_only",
        "nfft",
        "window_size",
        "hop_length",
        "sampling_rate",
        "fmin",
        "fmax",
        "threshold_ema_dead_code",  # training only
        "position_embedding_type",
        "model_type",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
    }
)


@dataclass(frozen=True)
class AudioTokenizerConfig:
    """Encoder hyper-parameters (defaults: the tokenizer config class's, see the module docstring)."""

    n_mels: int = 80
    d_model: int = 768
    encoder_layers: int = 8
    encoder_attention_heads: int = 12
    encoder_ffn_dim: int = 3072
    kernel_size: int = 3
    stride_size: int = 2
    avg_pooler: int = 1
    encoder_skip_layer_id: int | None = None  # 1-based: the output of layer id-1 is added back
    encoder_causal: bool = False
    encoder_attn_window_size: tuple[int, int] = NO_WINDOW
    hybrid_attention: bool = False
    swa_per_block: int = 2
    rope_theta: float = 10000.0
    rope_type: str = "default"
    activation_function: str = "gelu"
    ln_type: str = "LayerNorm"
    layer_norm_eps: float = 1e-5  # nn.LayerNorm's default; the file has no key for it
    num_quantizers: int = 12
    codebook_size: tuple[int, ...] = (1024,)  # one per quantizer after __post_init__

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.codebook_size)
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"codebook_size must list positive sizes, got {self.codebook_size!r}")
        # The reference extends a short list with its last size and ignores extra entries.
        sizes = (sizes + (sizes[-1],) * self.num_quantizers)[: self.num_quantizers]
        object.__setattr__(self, "codebook_size", sizes)
        object.__setattr__(
            self, "encoder_attn_window_size", tuple(int(w) for w in self.encoder_attn_window_size)
        )
        if self.num_quantizers <= 0:
            raise ValueError("num_quantizers is 0: this tokenizer has no RVQ, so it gives no codes")
        if self.d_model % self.encoder_attention_heads or (self.d_model // self.encoder_attention_heads) % 2:
            raise ValueError(
                f"d_model {self.d_model} / encoder_attention_heads {self.encoder_attention_heads} "
                "is not an even head width (RoPE rotates half-dims)"
            )
        if len(self.encoder_attn_window_size) != 2:
            raise ValueError(
                f"encoder_attn_window_size is (left, right), got {self.encoder_attn_window_size!r}"
            )
        if (
            self.encoder_skip_layer_id is not None
            and not 1 <= self.encoder_skip_layer_id <= self.encoder_layers
        ):
            raise ValueError(
                f"encoder_skip_layer_id {self.encoder_skip_layer_id} is not a layer (1..{self.encoder_layers})"
            )
        for name, want in (
            ("activation_function", "gelu"),
            ("ln_type", "LayerNorm"),
            ("rope_type", "default"),
        ):
            if getattr(self, name) != want:
                raise ValueError(f"{name} {getattr(self, name)!r} is not supported (only {want!r})")
        if self.swa_per_block < 1 or min(self.kernel_size, self.stride_size, self.avg_pooler) < 1:
            raise ValueError("swa_per_block, kernel_size, stride_size and avg_pooler must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    def layer_window(self, i: int) -> tuple[int, int]:
        """(left, right) window of layer i; (-1, -1) is full attention."""
        if self.hybrid_attention and i % self.swa_per_block == self.swa_per_block - 1:
            return NO_WINDOW
        return (self.encoder_attn_window_size[0], self.encoder_attn_window_size[1])

    def conv_frames(self, mel_frames: int) -> int:
        """Frames out of the two convolutions (conv1 keeps the length, conv2 strides)."""
        same = mel_frames + 3 - self.kernel_size
        return (same + 2 - self.kernel_size) // self.stride_size + 1

    def code_frames(self, mel_frames: int) -> int:
        """Codes of one segment of ``mel_frames`` (after the downsample, ceil)."""
        return -(-self.conv_frames(mel_frames) // self.avg_pooler)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioTokenizerConfig:
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown: list[str] = []
        for key, value in d.items():
            if key in known:
                kwargs[key] = value
            elif key not in _IGNORED and not key.startswith(_IGNORED_PREFIXES):
                unknown.append(key)
        if unknown:
            log.warning("ignoring unknown audio_tokenizer config keys %s", sorted(unknown))
        if "codebook_size" in kwargs:
            cb = kwargs["codebook_size"]
            kwargs["codebook_size"] = (int(cb),) if isinstance(cb, int) else tuple(int(s) for s in cb)
        if kwargs.get("encoder_attn_window_size") is None:
            kwargs.pop("encoder_attn_window_size", None)
        else:
            kwargs["encoder_attn_window_size"] = tuple(int(w) for w in kwargs["encoder_attn_window_size"])
        if "rope_theta" in kwargs:
            kwargs["rope_theta"] = float(kwargs["rope_theta"])
        for key in ("encoder_causal", "hybrid_attention"):
            if key in kwargs:
                kwargs[key] = bool(kwargs[key])
        return cls(**kwargs)
