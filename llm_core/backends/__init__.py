"""Backends: which kernels compute a layer's attention, MoE, RMSNorm, or a whole decoder layer.

The model files describe the model (parameters, shapes, the order of operations); the kernels that
run those operations are chosen once per engine by ``selector.select_backends`` from the device,
the dtype and which extensions are built, and handed to the model by its ``after_load`` hook. Four
kinds, each an abstract class with its implementations:

    attention  ``AttentionBackend``: the attention between the two projections (rotary, KV store,
               paged attention): "torch" (the reference), "cpu" (the C kernel), "triton" (CUDA)
    moe        ``MoEBackend``: the router and the routed experts: "torch", "cpu"
    norm       ``NormBackend``: RMSNorm, alone and fused with the residual add: "torch", "cpu"
    layer      ``LayerBackend``: a whole pre-norm block in one call when it supports the block:
               "none" (the model runs its modules), "cpu" (the C decoder-layer kernel)

Each backend also owns the weight layout its kernels read: the model offers a module's parameters
to the backend's pack hook after loading (``pack_attention``, ``pack_experts``, ``LayerBackend.pack``)
and stores what comes back. The hook runs again whenever ``after_load`` is called (after a move or a
change of weights); nothing checks tensor identity at step time.

Shape: an explicit backend object per kind, chosen once and held by the modules (as mini-sglang's
attention backend), not per-op dispatch on the platform (as vLLM's ``CustomOp``). Why: the choice
here depends on dtype and on which C extensions loaded, not only on the device; one backend (the
layer kernel) spans several ops, which per-op dispatch cannot express; and an object with a name
is what the engine reports and what a test overrides, in one place.

Beside torch it uses ``llm_core.kernels`` (the kernels and their wrappers) and ``epd_common``; the
models import the backends, never the reverse.

May import: llm_core.kernels, epd_common; never: llm_core.models, llm_core.serving.
"""
