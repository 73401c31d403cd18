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


def test_a_stage_slower_than_measured_scales_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items done later than their admission estimate (a neighbour took the cores) lengthen the
    wait the next item is admitted with; Retry-After follows the median, not the tail."""
    clock = [0.0]
    monkeypatch.setattr("epd_common.admission.time.monotonic", lambda: clock[0])
    stage = StageWork("patches", seed_per_s=1000.0, deadline_s=2.0)  # learned from waits of 0.9 s up
    for _ in range(8):
        stage.rate.observe(1000.0, 1.0)  # measured: 1000 patches/s
    stage.admit("head", 1000.0)  # alone: nothing ahead, nothing learned
    for i in range(16):
        stage.admit(f"img{i}", 1000.0)  # behind the head: estimated (i + 2) s
    clock[0] = 100.0  # every one of them done far later than estimated
    for i in range(16):
        stage.finish(f"img{i}", ok=True)
    stage.finish("head", ok=True)
    unscaled = stage.rate.expected_wait_s(1000.0)
    assert stage.expected_wait_s(1000.0) == pytest.approx(3.0 * unscaled)  # x3: the cap
    assert stage.typical_wait_s(1000.0) == pytest.approx(3.0 * unscaled)
