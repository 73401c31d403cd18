"""Text in and out: the tokenizer and the checkpoint's chat template."""
