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
Beside torch it takes the attention and its segments from ``encoder.kernels``, RMSNorm from
``encoder.models.tower``, the pad-count rule and the audio settings from ``media_io`` and, in
``family`` only, the readers from ``epd_common.checkpoint``; nothing of HTTP, the worker or the cache.

May import: encoder.kernels, encoder.models.tower, epd_common.checkpoint, media_io.audio_config,
media_io.audio_settings, media_io.audio_tokens; never: encoder.caches, encoder.serving.
"""
