"""One request's media seconds (media_io/media_seconds.py): durations from container headers,
added item by item against the request's budget."""

from __future__ import annotations

import pytest

from media_io.config import MediaLimits
from media_io.errors import MediaTooLarge
from media_io.media_seconds import MediaSeconds, declared_media_seconds
from tests.fixtures.video_factory import make_clip
from tests.media_io.test_audio_bomb import wav


def test_headers_say_how_long_a_clip_is() -> None:
    limits = MediaLimits()
    assert declared_media_seconds(wav(8000, 3.0), "audio", limits) == pytest.approx(3.0)
    assert declared_media_seconds(make_clip(64, 48, fps=10.0, seconds=2.0), "video", limits) == pytest.approx(
        2.0, abs=0.15
    )


def test_bytes_without_such_a_stream_count_nothing() -> None:
    limits = MediaLimits()
    assert declared_media_seconds(b"not a container", "audio", limits) == 0.0
    assert declared_media_seconds(wav(8000, 1.0), "video", limits) == 0.0  # no video stream


def test_the_item_that_crosses_the_budget_is_named_with_the_flag() -> None:
    seconds = MediaSeconds(budget_s=10.0)
    seconds.add(4.0, "a")
    seconds.add(6.0, "b")  # exactly the budget: taken
    with pytest.raises(MediaTooLarge) as raised:
        seconds.add(0.5, "c", what="encoded")
    assert raised.value.item == "c" and raised.value.status == 413
    assert "10.5 s (encoded)" in raised.value.message
    assert "--limits-max-request-media-seconds" in raised.value.message
