"""The epd service: configuration, the ``epd`` CLI, the ingress HTTP app, the launcher that
starts and supervises the encoder and LLM processes (or a local vLLM server), the language-model
backends a chat is answered by (``llm_backends``), metrics and the OpenAI-compatible API."""

__version__ = "0.1.0"
