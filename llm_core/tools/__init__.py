"""Offline work over the models that is not a model and not serving: ``mtp_distill`` trains
multi-token-prediction heads for a target that has none (how the embedded default gets its heads).

It may import ``llm_core.models``, ``llm_core.caches``, ``llm_core.kernels`` and ``epd_common``; it
never imports ``llm_core.serving``. The product needs it at run time in one place:
``llm_core.models.checkpoint`` distills the embedded default's heads the first time that checkpoint
is built (``epd serve`` with no model given).
"""
