"""A worker's admission work per stage: patches and mel frames queue and are measured apart."""

from __future__ import annotations

import pytest

from encoder.serving.stage_work import StageWork


def test_each_stage_waits_on_its_own_queue_at_its_own_rate() -> None:
    pixels, sound = StageWork("patches", seed_per_s=1000.0), StageWork("mel frames", seed_per_s=100.0)
    pixels.admit("img", 5000.0)
    assert pixels.expected_wait_s(1000.0) == pytest.approx(6.0)
    assert sound.expected_wait_s(300.0) == pytest.approx(3.0)  # 5000 patches are not ahead of it
    sound.admit("clip", 300.0)
    sound.correct("clip", 600.0)  # decoded: longer than its header said
    assert sound.queued == 600.0 and "clip" in sound and "clip" not in pixels
    sound.finish("clip", ok=True)
    pixels.finish("img", ok=True)
    assert sound.queued == 0.0 and pixels.queued == 0.0
    with pytest.raises(KeyError):
        sound.finish("clip", ok=True)  # finished twice is a bug in the caller
