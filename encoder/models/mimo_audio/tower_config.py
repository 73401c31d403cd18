"""AudioTowerConfig: MiMo-V2.5's LLM-side audio tower, from config.json's ``audio_config`` and the
audio fields of its ``processor_config`` (/work/shared/reference/mimo_v25.md section 1).

The release's gotchas, handled here:
    ``speech_vocab_size`` and ``speech_zeroemb_idx`` are strings ("1280", "1024"): one number for
    every channel, or a "-"-separated list of one per channel; ``input_local_head_dim`` only
    restates ``input_local_dim / input_local_attn_heads`` (checked); ``partial_rotary_factor`` is
    1.0 in the release and the reference's Qwen2 layers rotate the whole head whatever it says, so
    any other value is refused rather than read one way or the other; the RMSNorm eps has no key
    (Qwen2's 1e-6).

The processor fields (kernel, stride, avg pooler, group, segment) give the pad-count rule
(``media_io.audio_tokens.AudioTokenRule``); where both blocks name a value (group size, channels,
segment size, zero-embedding index) they must agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from media_io.audio_tokens import AudioTokenRule

log = logging.getLogger(__name__)

_IGNORED = frozenset({"input_local_hidden_dropout", "input_local_head_dim", "model_type", "architectures"})


def per_channel(value: str | int | list[int] | tuple[int, ...], channels: int, name: str) -> tuple[int, ...]:
    """One int per channel from the release's spellings: "1280", 1280, "1025-1025-129-...", or a list."""
    if isinstance(value, str):
        parts = [int(p) for p in value.split("-")] if "-" in value else [int(value)] * channels
    elif isinstance(value, int):
        parts = [value] * channels
    else:
        parts = [int(p) for p in value]
    if len(parts) != channels:
        raise ValueError(f"{name} lists {len(parts)} values for {channels} audio channels: {value!r}")
    return tuple(parts)


@dataclass(frozen=True)
class AudioTowerConfig:
    """LLM-side tower hyper-parameters (defaults: the released MiMo-V2.5 values)."""

    audio_channels: int = 20
    group_size: int = 4
    input_local_layers: int = 6
    input_local_dim: int = 1024
    input_local_attn_heads: int = 16
    input_local_intermediate_size: int = 4096
    input_full_attention: bool = True  # bidirectional within a group (False: causal within it)
    out_hidden_size: int = 4096
    rope_theta: float = 640000.0
    partial_rotary_factor: float = 1.0
    projection_layers: int = 2  # 1: one Linear; 2: Linear -> GELU -> Linear (hidden 4 x in)
    add_post_norm: bool = True  # the local transformer's final RMSNorm
    speech_vocab_size: tuple[int, ...] = (1280,) * 20
    speech_zeroemb_idx: tuple[int, ...] = (1024,) * 20
    audio_segment_size: int = 6000
    rms_norm_eps: float = 1e-6
    rule: AudioTokenRule = field(default_factory=AudioTokenRule)
    n_mels: int = 128

    def __post_init__(self) -> None:
        if self.input_local_dim % self.input_local_attn_heads or self.head_dim % 2:
            raise ValueError(
                f"input_local_dim {self.input_local_dim} / input_local_attn_heads "
                f"{self.input_local_attn_heads} is not an even head width"
            )
        if self.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} is not supported (only 1.0)"
            )
        if self.projection_layers not in (1, 2):
            raise ValueError(f"projection_layers {self.projection_layers} is not supported (1 or 2)")
        for name in ("speech_vocab_size", "speech_zeroemb_idx"):
            if len(getattr(self, name)) != self.audio_channels:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries for {self.audio_channels} channels"
                )
        if self.rule.group_size != self.group_size or self.rule.segment_size != self.audio_segment_size:
            raise ValueError(
                f"processor_config (group {self.rule.group_size}, segment {self.rule.segment_size}) disagrees "
                f"with audio_config (group {self.group_size}, segment {self.audio_segment_size})"
            )

    @property
    def head_dim(self) -> int:
        return self.input_local_dim // self.input_local_attn_heads

    @property
    def projection_in(self) -> int:
        """Values of one flattened group: group_size * input_local_dim (4096)."""
        return self.group_size * self.input_local_dim

    @classmethod
    def from_dicts(
        cls, audio_config: dict[str, Any], processor_config: dict[str, Any] | None = None
    ) -> AudioTowerConfig:
        """From config.json's ``audio_config`` and (optional) ``processor_config`` blocks."""
        known = {f.name for f in fields(cls)} - {"rule", "n_mels"}
        kwargs: dict[str, Any] = {k: v for k, v in audio_config.items() if k in known}
        unknown = sorted(set(audio_config) - known - _IGNORED)
        if unknown:
            log.warning("ignoring unknown audio_config keys %s", unknown)
        channels = int(kwargs.get("audio_channels", cls.audio_channels))
        for name in ("speech_vocab_size", "speech_zeroemb_idx"):
            if name in kwargs:
                kwargs[name] = per_channel(kwargs[name], channels, name)
            elif channels != cls.audio_channels:
                raise ValueError(f"audio_config sets audio_channels {channels} but not {name}")
        heads = int(kwargs.get("input_local_attn_heads", cls.input_local_attn_heads))
        dim = int(kwargs.get("input_local_dim", cls.input_local_dim))
        head_dim = audio_config.get("input_local_head_dim")
        if head_dim is not None and int(head_dim) * heads != dim:
            raise ValueError(f"input_local_head_dim {head_dim} x {heads} heads != input_local_dim {dim}")
        p = processor_config or {}
        group = int(kwargs.get("group_size", cls.group_size))
        segment = int(kwargs.get("audio_segment_size", cls.audio_segment_size))
        rule = AudioTokenRule(
            kernel_size=int(p.get("audio_kernel_size", 3)),
            stride_size=int(p.get("audio_stride_size", 2)),
            avg_pooler=int(p.get("audio_avg_pooler", 2)),
            group_size=int(p.get("audio_group_size", group)),
            segment_size=int(p.get("audio_segment_size", segment)),
        )
        if int(p.get("audio_channels", channels)) != channels:
            raise ValueError(
                f"processor_config audio_channels {p['audio_channels']} != audio_config's {channels}"
            )
        zero = p.get("audio_zeroemb_idx")
        if (
            zero is not None
            and "speech_zeroemb_idx" in kwargs
            and tuple(int(z) for z in zero) != kwargs["speech_zeroemb_idx"]
        ):
            raise ValueError(f"processor_config audio_zeroemb_idx {zero} != audio_config speech_zeroemb_idx")
        if "rope_theta" in kwargs:
            kwargs["rope_theta"] = float(kwargs["rope_theta"])
        for key in ("input_full_attention", "add_post_norm"):
            if key in kwargs:
                kwargs[key] = bool(kwargs[key])
        return cls(**kwargs, rule=rule, n_mels=int(p.get("audio_n_mels", 128)))
