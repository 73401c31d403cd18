"""DecoderConfig: the hyper-parameters of a MiMo-V2-Flash-compatible model, read from config.json.

Two on-disk spellings are accepted (both map onto the same frozen dataclass):

- transformers' ``MiMoV2FlashConfig`` (``layer_types``, ``mlp_layer_types``, ``rope_parameters`` per
  layer type; SWA layers implicitly use ``2 * num_key_value_heads`` and always have sinks);
- the original Xiaomi release (``hybrid_layer_pattern`` 0 = full / 1 = SLIDING, ``moe_layer_freq``,
  ``swa_num_key_value_heads``, ``rope_theta`` / ``swa_rope_theta``, ``layernorm_epsilon``,
  ``sliding_window_size`` which excludes the query token, and wins over ``sliding_window``).

Conventions (they matter for the KV cache and the attention kernels):

- A window counts the query token: a query at position p in a windowed layer attends keys at
  positions p - W + 1 .. p (W keys including itself), plus the learned sink logit. ``window(i)`` is
  layer i's: ``layer_windows[i]`` when the config names one per layer (ours: a model whose layers
  use several windows), else ``sliding_window`` for every windowed layer.
- Layer i is full attention iff ``layer_types[i] == "full_attention"`` (by default i == 0 or
  (i + 1) % 6 == 0).
- The rotary part of each q/k head is its first ``rotary_dim(i)`` dims (``int(head_dim * factor)``
  rounded up to even, as transformers computes it).

This module knows nothing about tensors or weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd_common.checkpoint.config_json import read_config_json
from epd_common.checkpoint.errors import CheckpointError

FULL = "full_attention"
SLIDING = "sliding_attention"


class ConfigError(ValueError):
    """A config.json that cannot describe a MiMo-V2-Flash model; the message names the field."""


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Full attention for layer 0 and every 6th layer ((i + 1) % 6 == 0), sliding window elsewhere."""
    return tuple(FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class DecoderConfig:
    """Frozen model hyper-parameters. Use :meth:`from_hf_dict` / :meth:`from_pretrained_dir` to read
    a checkpoint's config.json; the constructor takes the canonical field names below."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP (layers with mlp_layer_types[i] == "dense")
    moe_intermediate_size: int  # per routed expert
    num_hidden_layers: int
    num_attention_heads: int  # same in both layer types
    num_key_value_heads: int  # full-attention layers
    swa_num_key_value_heads: int  # sliding-window layers
    head_dim: int  # q and k
    v_head_dim: int  # v (and the attention output per head)
    sliding_window: int  # the checkpoint's window: keys per query (query included) of windowed layers
    layer_types: tuple[str, ...] = ()  # FULL | SWA per layer; () = default pattern
    # Keys per query of each layer (None: full attention); () = ``sliding_window`` for every
    # windowed layer. A model whose layers use several windows names them here.
    layer_windows: tuple[int | None, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer; () = dense first, then MoE
    rope_theta: float = 5_000_000.0  # full-attention layers
    swa_rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.334
    swa_partial_rotary_factor: float = 0.334
    attention_value_scale: float = 0.707  # multiplies v before attention
    full_attention_sinks: bool = False  # learned per-head sink logit in full layers
    swa_attention_sinks: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    eos_token_id: int | None = None
    # M-RoPE (Qwen2-VL family): rotary frequencies split into (temporal, height, width) sections,
    # each driven by its own position axis; () = ordinary 1-D rotary. Sums to the rotary width / 2.
    mrope_section: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        if not self.mlp_layer_types:
            mlp = ("dense",) + ("sparse",) * (self.num_hidden_layers - 1)
            object.__setattr__(self, "mlp_layer_types", mlp)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        n = self.num_hidden_layers
        need(n > 0, f"num_hidden_layers must be positive, got {n}")
        need(len(self.layer_types) == n, f"layer_types has {len(self.layer_types)} entries for {n} layers")
        need(
            set(self.layer_types) <= {FULL, SLIDING},
            f"layer_types must be {FULL!r}/{SLIDING!r}: {self.layer_types}",
        )
        need(len(self.mlp_layer_types) == n, f"mlp_layer_types has {len(self.mlp_layer_types)} entries")
        need(
            set(self.mlp_layer_types) <= {"dense", "sparse"},
            f"mlp_layer_types must be 'dense'/'sparse': {self.mlp_layer_types}",
        )
        need(self.sliding_window >= 1, f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_windows:
            need(
                len(self.layer_windows) == n,
                f"layer_windows has {len(self.layer_windows)} entries for {n} layers",
            )
            need(
                all(
                    (w is None) == (t == FULL) and (w is None or w >= 1)
                    for w, t in zip(self.layer_windows, self.layer_types, strict=True)
                ),
                f"layer_windows {self.layer_windows} must be None exactly at the full-attention layers, else >= 1",
            )
        for kv_name in ("num_key_value_heads", "swa_num_key_value_heads"):
            kv = getattr(self, kv_name)
            need(
                kv >= 1 and self.num_attention_heads % kv == 0,
                f"{kv_name}={kv} must divide num_attention_heads={self.num_attention_heads}",
            )
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.mrope_section:
            need(len(self.mrope_section) == 3, f"mrope_section must have 3 entries, got {self.mrope_section}")
            for i in range(n):
                half = self.rotary_dim(i) // 2
                need(
                    sum(self.mrope_section) == half,
                    f"mrope_section {list(self.mrope_section)} sums to {sum(self.mrope_section)}, "
                    f"layer {i} rotates {half} frequency pairs",
                )
        if "sparse" in self.mlp_layer_types:
            e, g = self.n_routed_experts, self.n_group
            need(e % g == 0, f"n_routed_experts={e} must be divisible by n_group={g}")
            need(1 <= self.topk_group <= g, f"topk_group={self.topk_group} must be in [1, n_group={g}]")
            need(e // g >= 2, f"each expert group needs >= 2 experts (group score = top-2 sum), got {e // g}")
            k = self.num_experts_per_tok
            need(
                1 <= k <= self.topk_group * (e // g),
                f"num_experts_per_tok={k} exceeds the experts in the selected groups",
            )

    # ---- derived, per layer ------------------------------------------------------------------

    def is_full_layer(self, i: int) -> bool:
        """True when layer ``i`` attends over all previous tokens (reads/writes the full KV pool)."""
        return self.layer_types[i] == FULL

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def num_kv_heads(self, i: int) -> int:
        return self.num_key_value_heads if self.is_full_layer(i) else self.swa_num_key_value_heads

    def rope_theta_of(self, i: int) -> float:
        return self.rope_theta if self.is_full_layer(i) else self.swa_rope_theta

    def rope_dim(self, i: int) -> int:
        """``int(head_dim * partial_rotary_factor)``: sets the RoPE frequency spacing of layer ``i``."""
        factor = self.partial_rotary_factor if self.is_full_layer(i) else self.swa_partial_rotary_factor
        return int(self.head_dim * factor)

    def rotary_dim(self, i: int) -> int:
        """Leading dims of each q/k head that rotate (``2 * ceil(rope_dim / 2)``); the rest pass."""
        return 2 * ((self.rope_dim(i) + 1) // 2)

    def has_sinks(self, i: int) -> bool:
        return self.full_attention_sinks if self.is_full_layer(i) else self.swa_attention_sinks

    def window(self, i: int) -> int | None:
        """Keys per query (query included) for layer ``i``; None for full attention."""
        if self.layer_windows:
            return self.layer_windows[i]
        return None if self.is_full_layer(i) else self.sliding_window

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_full_layer(i))

    @property
    def window_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_full_layer(i))

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layer_ids)

    @property
    def num_window_layers(self) -> int:
        return len(self.window_layer_ids)

    # ---- loading -----------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DecoderConfig:
        """Build from a config.json dict (transformers' or the original Xiaomi spelling)."""
        d = dict(d)
        if d.get("text_config"):
            d = {**d, **d["text_config"]}
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ConfigError(f"config.json has no {key!r}")
        n = int(d["num_hidden_layers"])
        heads = int(d["num_attention_heads"])
        if int(d.get("swa_num_attention_heads", heads)) != heads:
            raise ConfigError("swa_num_attention_heads != num_attention_heads is not supported")
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // heads)
        v_head_dim = int(d.get("v_head_dim") or head_dim)
        for key, want in (("swa_head_dim", head_dim), ("swa_v_head_dim", v_head_dim)):
            if d.get(key) is not None and int(d[key]) != want:
                raise ConfigError(f"{key}={d[key]} differs from the full-attention value {want}")
        kv = int(d.get("num_key_value_heads") or heads)

        layer_types: tuple[str, ...]
        if d.get("layer_types"):
            layer_types = tuple(str(t) for t in d["layer_types"])
        elif d.get("hybrid_layer_pattern"):
            layer_types = tuple(SLIDING if int(p) else FULL for p in d["hybrid_layer_pattern"])
        else:
            layer_types = default_layer_types(n)
        mlp_layer_types: tuple[str, ...]
        if d.get("mlp_layer_types"):
            mlp_layer_types = tuple(str(t) for t in d["mlp_layer_types"])
        elif isinstance(d.get("moe_layer_freq"), list):
            mlp_layer_types = tuple("sparse" if int(f) else "dense" for f in d["moe_layer_freq"])
        else:
            mlp_layer_types = ()

        # transformers stores window = previous tokens + query; the original release stores both
        # `sliding_window` and `sliding_window_size` (previous tokens only, 128 in MiMo-V2.5 with
        # `sliding_window` also 128). The latter wins, as in sglang (which attends to that many
        # previous tokens plus the query) and transformers' MiMoV2FlashConfig (window = size + 1).
        if d.get("sliding_window_size") is not None:
            window = int(d["sliding_window_size"]) + 1
        elif d.get("sliding_window") is not None:
            window = int(d["sliding_window"])
        else:
            raise ConfigError("config.json has neither 'sliding_window' nor 'sliding_window_size'")
        # ours (``to_hf_dict``): a window per layer, for models whose layers use several
        layer_windows = tuple(None if w is None else int(w) for w in d.get("layer_windows") or ())

        rope = d.get("rope_parameters") or {}
        full_rope = rope.get(FULL, {}) if isinstance(rope, dict) else {}
        window_rope = rope.get(SLIDING, {}) if isinstance(rope, dict) else {}
        for name, params in ((FULL, full_rope), (SLIDING, window_rope)):
            if params and params.get("rope_type", "default") != "default":
                raise ConfigError(f"rope_parameters[{name!r}].rope_type={params['rope_type']!r} unsupported")
        prf = float(d.get("partial_rotary_factor") or 0.334)

        is_hf = "rope_parameters" in d or "layer_types" in d
        window_kv_default = 2 * kv if is_hf else kv
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        scale = d.get("attention_value_scale")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size") or 4 * int(d["hidden_size"])),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d.get("intermediate_size") or 1),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            swa_num_key_value_heads=int(d.get("swa_num_key_value_heads") or window_kv_default),
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            sliding_window=window,
            layer_types=layer_types,
            layer_windows=layer_windows,
            mlp_layer_types=mlp_layer_types,
            rope_theta=float(full_rope.get("rope_theta", d.get("rope_theta", 5_000_000.0))),
            swa_rope_theta=float(window_rope.get("rope_theta", d.get("swa_rope_theta", 10_000.0))),
            partial_rotary_factor=float(full_rope.get("partial_rotary_factor", prf)),
            swa_partial_rotary_factor=float(window_rope.get("partial_rotary_factor", prf)),
            attention_value_scale=1.0 if scale is None else float(scale),
            full_attention_sinks=bool(d.get("add_full_attention_sink_bias", False)),
            swa_attention_sinks=bool(d.get("add_swa_attention_sink_bias", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            rms_norm_eps=float(d.get("rms_norm_eps") or d.get("layernorm_epsilon") or 1e-5),
            n_routed_experts=int(d.get("n_routed_experts") or d.get("num_local_experts") or 1),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 1),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            hidden_act=str(d.get("hidden_act", "silu")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 131072),
            eos_token_id=None if eos is None else int(eos),
            extra=d,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> DecoderConfig:
        """Read ``path/config.json`` (``ConfigError`` when it is missing or not a JSON object)."""
        try:
            raw = read_config_json(Path(path))
        except CheckpointError as e:
            raise ConfigError(str(e)) from e
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-style config.json dict. ``swa_num_key_value_heads`` and the sink flags are
        written explicitly for our loader; transformers ignores them (it derives 2x KV heads)."""
        return {
            "architectures": ["MiMoV2FlashForCausalLM"],
            "model_type": "mimo_v2_flash",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "swa_num_key_value_heads": self.swa_num_key_value_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            **({"layer_windows": list(self.layer_windows)} if self.layer_windows else {}),
            "mlp_layer_types": list(self.mlp_layer_types),
            "rope_parameters": {
                FULL: {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                },
                SLIDING: {
                    "rope_type": "default",
                    "rope_theta": self.swa_rope_theta,
                    "partial_rotary_factor": self.swa_partial_rotary_factor,
                },
            },
            "attention_value_scale": self.attention_value_scale,
            "add_full_attention_sink_bias": self.full_attention_sinks,
            "add_swa_attention_sink_bias": self.swa_attention_sinks,
            "attention_bias": self.attention_bias,
            "rms_norm_eps": self.rms_norm_eps,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": self.eos_token_id,
            "dtype": "float32",
        }
