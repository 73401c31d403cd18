"""Cross-request batching for the vision encoder: ``EncodeBatcher``, a ``ForwardBatcher`` whose
items are an image's or a video's patches and whose unit is a patch
(``encoder.serving.forward_batcher`` has the queue, the dispatch and the forward streams).

Items are packed in arrival order into one forward of the tower; attention never crosses items,
so each item's rows equal what it gets alone (up to float reassociation). A multi-frame item
(video) larger than the budget is split into runs of whole frames of at most a budget each, so its
forwards can go to several streams and no forward exceeds the budget; attention never crosses a
frame, so the concatenated parts equal the item encoded whole.

This module knows nothing of HTTP, media decoding or the embedding cache.
"""

from __future__ import annotations

import torch

from encoder.models.family import VisionTower
from encoder.serving.forward_batcher import BatcherStats, EncodeResult, ForwardBatcher, QueueFull
from media_io.preprocess import Patches

__all__ = ["BatcherStats", "EncodeBatcher", "EncodeResult", "QueueFull"]


class EncodeBatcher(ForwardBatcher[Patches]):
    """Batches ``encode`` calls into shared forwards of ``model``.

    ``patch_budget``: most patches in one forward (a larger single item runs alone).
    ``max_wait_ms``: longest an item waits for companions before its batch is dispatched.
    ``max_queue_patches``: bound on queued patches (default 8 budgets, at least 524288 so that a
    small CPU budget still queues half a dozen one-minute videos, ~72k patches each at 640x360).
    ``forward_streams``: forwards that may run at once, each in its own thread.
    """

    def __init__(
        self,
        model: VisionTower,
        patch_budget: int = 16384,
        max_wait_ms: float = 5.0,
        max_queue_patches: int | None = None,
        output_device: str | torch.device = "cpu",
        forward_streams: int = 1,
    ) -> None:
        if patch_budget <= 0:
            raise ValueError(f"patch_budget must be positive, got {patch_budget}")
        super().__init__(
            patch_budget,
            max_wait_ms,
            max_queue_patches if max_queue_patches is not None else max(8 * patch_budget, 1 << 19),
            output_device,
            forward_streams,
        )
        self.model = model

    @property
    def patch_budget(self) -> int:
        return self.budget

    @property
    def max_queue_patches(self) -> int:
        return self.max_queue_units

    def _split(self, patches: Patches) -> list[Patches]:
        """Runs of whole frames of at most ``patch_budget`` patches (one frame when a frame alone is
        larger); the item itself when it fits or has one frame.

            rows:  [ frame 0 | frame 1 | frame 2 | frame 3 | frame 4 ]   t=5, budget = 2 frames
            parts: [ f0 f1 ][ f2 f3 ][ f4 ]
        """
        t, h, w = patches.grid_thw
        if t == 1 or t * h * w <= self.budget:
            return [patches]
        per = max(1, self.budget // (h * w))  # frames per part
        return [
            Patches(patches.pixel_values[f * h * w : min(t, f + per) * h * w], (min(t, f + per) - f, h, w))
            for f in range(0, t, per)
        ]

    def _validate(self, patches: Patches) -> int:
        cfg = self.model.config
        t, h, w = patches.grid_thw
        pv = patches.pixel_values
        if t < 1 or h < 1 or w < 1 or h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
            raise ValueError(f"grid_thw {patches.grid_thw} is not a positive grid of whole merge groups")
        if pv.dim() != 2 or tuple(pv.shape) != (t * h * w, cfg.patch_dim):
            raise ValueError(
                f"pixel_values shape {tuple(pv.shape)} does not match grid_thw {patches.grid_thw} "
                f"(expected ({t * h * w}, {cfg.patch_dim}))"
            )
        return t * h * w

    def _forward(self, items: list[Patches]) -> list[torch.Tensor]:
        model = self.model
        grids = [p.grid_thw for p in items]
        layout = model.layout(grids)
        if len(items) == 1:
            pixels = items[0].pixel_values
        else:
            # One staging buffer (pinned when the model is on CUDA, so the upload is asynchronous).
            total = sum(p.pixel_values.shape[0] for p in items)
            pin = model.device.type == "cuda"
            pixels = torch.empty((total, model.config.patch_dim), dtype=torch.float32, pin_memory=pin)
            offset = 0
            for p in items:
                n = p.pixel_values.shape[0]
                pixels[offset : offset + n].copy_(p.pixel_values)  # [n, patch_dim]
                offset += n
        with torch.inference_mode():
            out = model.forward_layout(pixels, layout)  # [N // unit, out_hidden]
            out = out.to(self.output_device)
        unit = model.config.merge_unit
        sizes = [t * h * w // unit for t, h, w in grids]
        # Clone so one kept embedding does not pin the whole batch's output buffer.
        return [part.clone() for part in out.split(sizes)] if len(items) > 1 else [out]
