"""Tokenizer: byte-level default ids, round trips, chat template, incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llm_core.prompts.tokenizer import (
    SPECIAL_TOKENS,
    ChatTemplateError,
    Tokenizer,
    TokenizerError,
    build_default_tokenizer,
    load_tokenizer,
    save_default_tokenizer,
)

TOK = Tokenizer(build_default_tokenizer())


def test_agreed_ids() -> None:
    assert TOK.encode("A") == [65]
    assert TOK.encode("é") == list("é".encode())
    assert TOK.encode("".join(SPECIAL_TOKENS)) == list(range(256, 263))
    assert TOK.eos_token_id == 256
    assert TOK.im_end_token_id == 258
    assert TOK.image_token_id == 261
    assert TOK.video_token_id == 262


# `encode` (for the server's own text) reads a spelled special token as that token; keep plain
# text here (request text goes through `encode_text`: test_request_text.py).
PLAIN_TEXT = st.text().filter(lambda t: "<|" not in t)


@settings(max_examples=200, deadline=None)
@given(PLAIN_TEXT)
def test_byte_level_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text


def test_decode_skips_specials_and_out_of_vocab() -> None:
    ids = [257, *b"hi", 258, 400, 511]
    assert TOK.decode(ids) == "hi"
    assert TOK.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_save_and_load(tmp_path: Path) -> None:
    path = save_default_tokenizer(tmp_path)
    assert path.name == "tokenizer.json" and path.is_file()
    loaded = load_tokenizer(tmp_path)
    text = "héllo <|im_start|> wörld 🙂"
    assert loaded.encode(text) == TOK.encode(text)
    # Only the embedded default (no directory) gets the byte-level tokenizer.
    assert load_tokenizer(None).encode(text) == TOK.encode(text)


def test_directory_without_tokenizer_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512}))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found") as exc:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(exc.value)


def test_unparsable_tokenizer_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizers file"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("nested", [False, True])
def test_tokenizer_larger_than_the_embedding_is_an_error(tmp_path: Path, nested: bool) -> None:
    save_default_tokenizer(tmp_path)  # ids 0..262
    rows = {"vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": rows} if nested else rows))
    with pytest.raises(TokenizerError, match=r"ids up to 262 .* declares vocab_size 256"):
        load_tokenizer(tmp_path)
    # One row per id is enough.
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 263}))
    assert load_tokenizer(tmp_path).vocab_size == 263


def test_chat_template_with_media_runs() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "image", "num_tokens": 3},
                {"type": "text", "text": "and"},
                {"type": "video", "num_tokens": 2},
            ],
        },
    ]
    text = TOK.apply_chat_template(msgs)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 3 + "<|vision_end|>and"
        "<|vision_start|>" + "<|video_pad|>" * 2 + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = TOK.encode(text)
    assert ids.count(TOK.image_token_id) == 3
    assert ids.count(TOK.video_token_id) == 2
    assert not TOK.apply_chat_template(msgs[:1], add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.parametrize(
    ("msgs", "param"),
    [
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "image", "num_tokens": 0}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
    ],
)
def test_chat_template_errors_name_the_item(msgs: list, param: str) -> None:
    with pytest.raises(ChatTemplateError) as ei:
        TOK.apply_chat_template(msgs)
    assert ei.value.param == param


@settings(max_examples=200, deadline=None)
@given(PLAIN_TEXT)
@example("\ufffd")  # the text itself may hold replacement characters
def test_incremental_detokenize_never_splits_characters(text: str) -> None:
    det = TOK.detokenizer()
    deltas = [det.add(i) for i in TOK.encode(text)]
    deltas.append(det.flush())
    assert "".join(deltas) == text
    # A split character would show up as a replacement character the text does not contain.
    assert all(d.count("\ufffd") <= text.count("\ufffd") for d in deltas)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(PLAIN_TEXT, st.lists(st.integers(0, 40), max_size=8), st.sampled_from([263, 300, 10**6, -1]))
def test_incremental_detokenize_ignores_ids_outside_the_vocabulary(
    text: str, at: list[int], bad: int
) -> None:
    """Ids the vocabulary does not have (a random model emits them) decode to nothing wherever they
    come: the other ids' deltas are those of a stream without them."""
    ids = TOK.encode(text)
    clean, noisy = TOK.detokenizer(), TOK.detokenizer()
    want = [clean.add(i) for i in ids] + [clean.flush()]
    got: list[str] = []
    for k, i in enumerate(ids):
        for _ in range(at.count(k)):
            assert noisy.add(bad) == ""
        got.append(noisy.add(i))
    got.append(noisy.flush())
    assert got == want


def test_incremental_detokenize_invalid_bytes_and_specials() -> None:
    det = TOK.detokenizer()
    out = [det.add(0xE2), det.add(0x82)]  # first two bytes of "€": nothing may be emitted yet
    assert out == ["", ""]
    assert det.add(0xAC) == "€"
    assert det.add(256) == ""  # eos is skipped
    assert det.add(0xFF) == ""  # invalid byte held back until something follows
    assert det.add(ord("a")) == "\ufffda"
    assert det.add(0xC3) == ""
    assert det.flush() == "\ufffd"
    assert det.text == "€\ufffda\ufffd"


def test_text_only_tokenizer_has_no_media_ids() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer(HFTokenizer(models.WordLevel(vocab={"a": 0, "b": 1}, unk_token="a")))
    assert tok.eos_token_id is None and tok.image_token_id is None and tok.video_token_id is None
    assert tok.vocab_size == 2
