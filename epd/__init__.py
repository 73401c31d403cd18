"""The epd service: configuration, the ``epd`` CLI, the ingress HTTP app, the launcher that
starts and supervises the encoder and LLM processes (or a local vLLM server), the language-model
servers a chat is answered by (``llm_servers``), metrics and the OpenAI-compatible API.

It reaches into the roles only for what it wires or shares: the encoder's cache and worker, the
engine's server, prompts, request record and model check, the shared-memory KV names, and the
tools step that writes the embedded default LLM (``llm_core.tools.default_llm``); never an
engine's or a tower's internals.

May import: epd_common, media_io, encoder.caches, encoder.models, encoder.serving,
llm_core.kv_transfer, llm_core.models, llm_core.prompts, llm_core.request, llm_core.serving,
llm_core.tools; never: encoder.kernels, llm_core.backends, llm_core.caches, llm_core.kernels.
"""

__version__ = "0.1.0"
