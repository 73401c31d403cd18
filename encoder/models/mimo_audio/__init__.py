"""MiMo-V2.5's audio encoder as torch modules (/work/shared/reference/mimo_v25.md sections 1, 4, 6).

    log-mel [T_mel, 128] per clip, cut into ``audio_segment_size`` (6000 frame, 60 s) segments
      -> frozen audio tokenizer (``audio_tokenizer/``): conv stem, RoPE transformer with a skip,
         stride-2 downsample, 20-codebook RVQ                      -> codes [T', 20] at 25 Hz
      -> LLM-side tower (``audio_encoder.*`` of the main checkpoint): summed speech embeddings,
         groups of 4, input local transformer, projection          -> one row per <|audio_pad|>

Owns: the two configs (``tokenizer_config``, ``tower_config``), the modules (``tokenizer``,
``rvq``, ``tower``, ``local_transformer``), their packed attention (``window_attention``) and
rotary (``rope``), the checkpoint names (``weights``), the clip-level driver (``encoder``) and
the checkpoint family (``family``: which files hold it, its log-mel settings, loading).
Imports torch, ``encoder.kernels`` (attention), ``encoder.models.packed_layout`` (segments),
``encoder.models.tower`` (RMSNorm), ``media_io`` (the pad-count rule, the audio settings) and, in
``family`` only, ``epd_common.checkpoint`` (the readers); nothing of HTTP, the worker or the cache.
"""
