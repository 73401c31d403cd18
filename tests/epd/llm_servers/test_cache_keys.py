"""The keys the ingress routes a prompt on (epd/llm_servers/cache_keys.py) for audio media."""

from __future__ import annotations

from tokenizers import AddedToken

from epd.llm_servers.cache_keys import prompt_cache_keys
from epd_common.messages.cache_keys import media_pseudo_id
from llm_core.prompts.tokenizer import AUDIO_PAD, Tokenizer, build_default_tokenizer


def audio_tokenizer() -> Tokenizer:
    hf = build_default_tokenizer()
    hf.add_special_tokens([AddedToken(AUDIO_PAD, special=True, normalized=False)])
    return Tokenizer(hf)


def test_audio_runs_route_on_their_clip() -> None:
    tok = audio_tokenizer()
    aud, vid = tok.audio_token_id, tok.video_token_id
    assert aud is not None and vid is not None
    prompt = [1, vid, vid, 2, aud, 3, vid, vid, 4, aud, aud, 5]
    media = [("v", 4, "video"), ("track-a", 3, "audio")]
    keys = prompt_cache_keys(tok, prompt, media)
    assert keys[1] == keys[7] == media_pseudo_id("v")
    assert keys[4] == keys[9] == keys[10] == media_pseudo_id("track-a")
    other = prompt_cache_keys(tok, prompt, [("v", 4, "video"), ("track-b", 3, "audio")])
    assert other[:4] == keys[:4] and other[4] != keys[4]
    # rows that do not line up, or a modality the tokenizer has no pad for: plain ids (the engine
    # answers the 4xx)
    assert prompt_cache_keys(tok, prompt, [("v", 4, "video"), ("t", 2, "audio")]) == prompt
    assert prompt_cache_keys(Tokenizer(build_default_tokenizer()), prompt, media) == prompt
