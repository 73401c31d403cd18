"""Video probe: container facts, caps checked before decoding, and the bad-video corpus."""

from __future__ import annotations

import av
import numpy as np
import pytest

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaError, MediaTooLarge
from media_io.video import decode_video, probe_video
from media_io.video_probe import scan_video
from tests.fixtures.video_factory import make_clip, make_vfr_clip
from tests.media_io import bad_video


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(320, 240, fps=10.0, seconds=3.0, keyint=10, bframes=2)


def test_probe_reports_the_container_facts(clip: bytes) -> None:
    info = probe_video(clip, item="clip.mp4")
    assert info.has_video and info.codec == "h264"
    assert (info.width, info.height) == (320, 240)
    assert info.fps == pytest.approx(10.0)
    assert info.num_frames == 30
    assert info.duration_s == pytest.approx(3.0, abs=0.11)
    assert info.keyframe_times == pytest.approx((0.0, 1.0, 2.0))


def test_frame_table_is_display_order_and_starts_at_a_keyframe(clip: bytes) -> None:
    table = scan_video(clip).table
    assert len(table.pts) == 30
    assert np.all(np.diff(table.pts) > 0)  # B-frames are demuxed out of order; the table is sorted
    assert table.keyframe_pts[0] == table.pts[0]
    assert set(table.keyframe_pts.tolist()) <= set(table.pts.tolist())


def test_probe_of_a_variable_frame_rate_clip() -> None:
    stamps = [0, 100, 150, 400, 410, 420, 1000, 1500]
    table = scan_video(make_vfr_clip(stamps)).table
    seconds = [table.seconds(int(p - table.pts[0])) for p in table.pts]
    assert seconds == pytest.approx([s / 1000 for s in stamps], abs=1e-3)


@pytest.mark.parametrize(
    ("limits", "what"),
    [
        (MediaLimits(max_video_pixels_per_frame=320 * 240 - 1), "pixels"),
        (MediaLimits(max_video_seconds=2.0), "lasts"),
        (MediaLimits(max_bytes=100), "bytes"),
    ],
)
def test_caps_raise_media_too_large(clip: bytes, limits: MediaLimits, what: str) -> None:
    with pytest.raises(MediaTooLarge, match=what) as err:
        probe_video(clip, item="clip.mp4", limits=limits)
    assert err.value.status == 413 and err.value.item == "clip.mp4"


def test_huge_declared_duration_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bad_video.huge_duration_mp4(hours=2.0)
    assert len(data) < 20_000  # a tiny file, a long declared duration

    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("decoded before the duration cap was checked")

    monkeypatch.setattr(av.container.InputContainer, "decode", no_decoding)
    with pytest.raises(MediaTooLarge, match="7200"):
        decode_video(data, item="long.mp4")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (bad_video.audio_only_mp4, "no video stream"),
        (lambda: bad_video.truncated_mp4(0.5, faststart=False), "cannot open"),
        (lambda: bad_video.truncated_mp4(0.5, faststart=True), "truncated"),
        (bad_video.corrupt_header, "cannot open"),
        (lambda: b"", "empty"),
        (lambda: b"<html><body>not a video</body></html>" * 20, "cannot open"),
    ],
)
def test_bad_videos_raise_bad_media_naming_the_item(make, match: str) -> None:
    data = make()
    for call in (probe_video, decode_video):
        with pytest.raises(BadMedia, match=match) as err:
            call(data, item="upload[3]")
        assert err.value.item == "upload[3]" and "upload[3]" in str(err.value)
        assert err.value.status == 400


def test_corrupt_payload_fails_cleanly_or_decodes_to_the_right_shape() -> None:
    data = bad_video.corrupt_payload()
    try:
        out = decode_video(data, item="noise.mp4", workers=1)
    except MediaError as e:
        assert isinstance(e, BadMedia) and e.item == "noise.mp4"
    else:
        assert out.frames.shape[0] == len(out.indices) and out.frames.dtype == np.uint8
