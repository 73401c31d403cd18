"""The engine and its process: the scheduler and waiting queue over the request record
(``llm_core.request``: ``Request``, frozen, built once per request; ``Sequence``, the scheduler's
state of it), the scheduler's output (``scheduler_output.SchedulerOutput``, the model runner's only
input), the page tables a step reads (``page_tables``), the model runner, sampling, speculative
decoding (its per-request drafts in ``draft_state``, keyed by request id), streams and the
completions server.

May import: llm_core.backends, llm_core.caches, llm_core.kernels, llm_core.kv_transfer,
llm_core.models, llm_core.prompts, llm_core.request, epd_common; never: llm_core.tools.
"""
