"""The engine and its process: sequences, the scheduler and waiting queue, the model runner, sampling, streams and the completions server."""
