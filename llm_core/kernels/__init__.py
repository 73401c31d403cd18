"""The kernels under the decoder and their Python wrappers: paged attention (torch reference, C,
Triton), the C decoder-layer, MoE and RMSNorm kernels, the rotary rotation, the attention batch
(``attention_batch``), and which of them a process runs (``active_paths``).

Which kernel a model runs is chosen in ``llm_core.backends``; the models do not import the
``cpu_*`` wrappers. May import: torch, numpy, triton (``triton_attention`` only), ``epd_common``.
"""
