"""The engine and its process: the request record (``request.Request``, frozen, built once per
request; ``sequence.Sequence``, the scheduler's state of it), the scheduler and waiting queue, the
scheduler's output (``scheduler_output.SchedulerOutput``, the model runner's only input), the
model runner, sampling, speculative decoding (its per-request drafts in ``draft_state``, keyed by
request id), streams and the completions server.

May import ``llm_core.models``, ``llm_core.backends``, ``llm_core.caches``, ``llm_core.kernels``,
``llm_core.kv_transfer``, ``llm_core.prompts`` and ``epd_common``; never ``encoder`` or ``epd``.
"""
