"""The vision encoder side: a Qwen2.5-VL-compatible ViT, checkpoint loading, the cross-request
batcher, the worker process, the node-shared embedding cache and the consistent-hash router.

It knows nothing of the language model or of the ingress's HTTP API.
"""
