"""Offline work over the models that is not a model and not serving: ``mtp_distill`` trains
multi-token-prediction heads for a target that has none (how the embedded default gets its heads).

The product needs it at run time in one place: ``llm_core.models.checkpoint`` distills the
embedded default's heads the first time that checkpoint is built (``epd serve`` with no model
given).

May import: llm_core.models, llm_core.caches, llm_core.kernels, epd_common; never: llm_core.serving.
"""
