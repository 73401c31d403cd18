"""The kernels under the decoder and their Python wrappers: paged attention (torch reference, C,
Triton), the C decoder-layer, MoE and RMSNorm kernels, the rotary rotation and the attention
batch (``attention_batch``). What a process runs is the chosen backends' to say
(``backends.selector.Backends.paths``).

Which kernel a model runs is chosen in ``llm_core.backends``; the models do not import the
``cpu_*`` wrappers. Beside torch, numpy and triton (``triton_attention`` only) they use
``epd_common`` only.

May import: epd_common; never: llm_core.backends, llm_core.models, llm_core.serving.
"""
