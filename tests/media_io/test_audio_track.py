"""Where a video's sound track is cut: the window of its sampled frames and the rows kept, against
the rule written out here from MiMo-V2.5's processor (sampled times, one spacing past the last)."""

from __future__ import annotations

import numpy as np
import pytest

from encoder.caches.media_key import media_key
from media_io.audio_settings import AudioSettings
from media_io.audio_track import TrackWindow, track_rows, track_window
from media_io.config import PreprocessConfig
from media_io.errors import BadMedia
from tests.fixtures.video_factory import make_clip
from tests.media_io.configs import MIMO_V25


def documented_window(frames: int, fps: float) -> TrackWindow:
    """MiMo-V2.5 at 1 fps, at least 8 frames, an even count, ``linspace`` floored; the window runs
    from the first sampled time to the last plus the first spacing."""
    count = max(int(frames / fps * 1.0), 8) // 2 * 2
    count = min(count, frames // 2 * 2)
    stamps = [int(i) / fps for i in np.linspace(0, frames - 1, num=count)]
    return TrackWindow(stamps[0], stamps[-1] + (stamps[1] - stamps[0]))


@pytest.mark.parametrize(("seconds", "fps"), [(2.0, 10.0), (7.0, 10.0), (12.0, 25.0), (30.0, 5.0)])
def test_the_window_is_the_sampled_frames_plus_one_spacing(seconds: float, fps: float) -> None:
    data = make_clip(64, 48, fps=fps, seconds=seconds)
    got = track_window(data, MIMO_V25)
    want = documented_window(round(seconds * fps), fps)
    assert got.start_s == 0.0
    assert got.end_s == pytest.approx(want.end_s, abs=1e-12)


def test_rows_past_the_window_are_cut_and_a_short_track_is_kept_whole() -> None:
    window = TrackWindow(0.0, 7.8)  # int(7.8 * 6.25) = 48
    assert track_rows(60, window, 6.25) == slice(0, 48)
    assert track_rows(40, window, 6.25) == slice(0, 40)
    assert track_rows(60, TrackWindow(2.0, 7.8), 6.25) == slice(12, 48)
    empty = track_rows(5, TrackWindow(2.0, 7.8), 6.25)  # ends before the first sampled frame
    assert empty.stop <= empty.start


def test_a_container_without_video_has_no_window() -> None:
    from tests.media_io.audio_files import encode, tone

    with pytest.raises(BadMedia):
        track_window(encode(tone(1.0, 24000, (440.0,)), 24000, "m4a"), MIMO_V25)


def test_a_track_keys_apart_from_the_clip_and_by_the_sampling_that_cuts_it() -> None:
    data, fp = b"\x00" * 64, "f" * 64
    plain = AudioSettings()
    track = plain.for_track(MIMO_V25)
    keys = {
        media_key(data, "audio", plain, fp),
        media_key(data, "audio", track, fp),
        media_key(data, "audio", plain.for_track(PreprocessConfig(**{**MIMO_V25.__dict__, "fps": 2.0})), fp),
        media_key(data, "audio", AudioSettings(tokens_per_second=5.0).for_track(MIMO_V25), fp),
    }
    assert len(keys) == 4
    # pixels only (resize bounds) do not move where the sound is cut
    resized = PreprocessConfig(**{**MIMO_V25.__dict__, "video_max_pixels": MIMO_V25.video_max_pixels // 2})
    assert media_key(data, "audio", plain.for_track(resized), fp) == media_key(data, "audio", track, fp)
    # /health carries the pads per second; the track's video settings are the reader's own
    assert AudioSettings.from_dict(AudioSettings(tokens_per_second=5.0).to_dict()).tokens_per_second == 5.0
