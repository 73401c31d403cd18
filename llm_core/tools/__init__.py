"""Offline work over the models that is not a model and not serving: ``mtp_distill`` trains
multi-token-prediction heads for a target that has none; ``default_llm`` writes the embedded
default checkpoint once (its weights, heads distilled by ``mtp_distill``, the tokenizer).

The product runs ``default_llm`` in one place: ``epd serve`` (before it starts its engines) and
``epd llm`` when no model is given. The loader and the engine only read checkpoints.

May import: llm_core.models, llm_core.caches, llm_core.kernels, llm_core.prompts, epd_common; never:
llm_core.serving.
"""
