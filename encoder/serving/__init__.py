"""The encoder worker process and its HTTP app, the cross-request batcher and the consistent-hash router."""
