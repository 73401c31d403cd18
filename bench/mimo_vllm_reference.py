"""MiMo-V2.5 through vLLM 0.32 against the release's own modeling code, measured on the tiny
checkpoint (the numbers of docs/models.md, "MiMo-V2.5 through vLLM"):

    python -m bench.mimo_vllm_reference [--images 8] [--json build/mimo_vllm_reference.json]

One vLLM (the CPU build, ``make vllm-peer``) on ``tests.fixtures.mimo_v2_vllm``'s checkpoint with
the full-attention tower (the tower vLLM's CPU build runs on raw images), its tower loaded and its
encoder outputs captured (``tests.fixtures.vllm_raw_tower``), and one ``epd serve --llm-server
vllm --llm-url`` in front of it. Three measurements:

1. Embeddings. Per image, the rows vLLM's raw-image path computed vs epd's (the release's
   preprocessing and merger): ``||vllm - epd|| / ||epd||``. Then each of vLLM's choices alone on
   the float64 reference tower (``tests.fixtures.mimo_vit_reference``): ImageNet mean/std instead
   of preprocessor_config.json's, a bilinear resize instead of bicubic, an RMSNorm merger instead
   of the weight-only LayerNorm; all three together must reproduce vLLM's rows (the split accounts
   for the whole difference). Vision sinks: the release's windowed tower with its sinks dropped
   (what a build that ignores them computes; vLLM 0.32's source applies them, Triton only).
2. Greedy ids. Per image chat, epd in front of vLLM vs vLLM given the raw image: the share of the
   new ids that are equal, and where the first differs.
3. The window. vLLM's prompt logprobs of a text prompt of 3W tokens vs transformers'
   ``MiMoV2FlashForCausalLM`` (the release's window: W previous tokens and the query): the first
   position that differs; and the greedy ids of prompts around and past W.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench.common import write_json
from bench.service_proc import ServiceProcess, free_port

NEW_TOKENS = 16
QUESTION = "Describe the picture."
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # vLLM's hard-coded mean/std
SIZES = [(150, 90), (64, 128), (224, 160), (96, 96), (200, 64), (128, 224), (60, 60), (256, 256)]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a.double() - b.double()).norm() / b.double().norm())


# -- pixels --------------------------------------------------------------------------------------


def grid_of(img: Image.Image) -> tuple[int, int]:
    """The resized (height, width): the release's smart_resize with the checkpoint's bounds."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from tests.fixtures import mimo_v2 as fx

    h, w = smart_resize(img.height, img.width, 32, fx.IMAGE_MIN_PIXELS, fx.IMAGE_MAX_PIXELS)
    return int(h), int(w)


def pixels(
    img: Image.Image, resize: str, mean_std: tuple[tuple[float, ...], tuple[float, ...]]
) -> torch.Tensor:
    """[h/16 * w/16, 1536] rows in merge-unit order: resized ("bicubic": PIL on the 8-bit image, as
    transformers' Qwen2VLImageProcessor; "bilinear": torch on the float image, align_corners False,
    as vLLM), normalized in 0-255 space, each 16x16 patch taken twice along time."""
    h, w = grid_of(img)
    if resize == "bicubic":
        x = torch.from_numpy(np.array(img.resize((w, h), Image.Resampling.BICUBIC))).permute(2, 0, 1).double()
    else:
        t = torch.from_numpy(np.array(img)).permute(2, 0, 1).float()[None]
        x = F.interpolate(t, (h, w), mode="bilinear", align_corners=False)[0].double()
    mean, std = (torch.tensor(v, dtype=torch.float64).view(3, 1, 1) * 255 for v in mean_std)
    x = (x - mean) / std  # [3, h, w]
    gh, gw = h // 16, w // 16
    x = torch.stack([x, x])  # [2 (time), 3, h, w]
    x = x.view(2, 3, gh // 2, 2, 16, gw // 2, 2, 16).permute(2, 5, 3, 6, 1, 0, 4, 7)
    return x.reshape(gh * gw, 3 * 2 * 16 * 16)


def release_mean_std(model_dir: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
    return tuple(cfg["image_mean"]), tuple(cfg["image_std"])


# -- 1. embeddings -------------------------------------------------------------------------------


def tower(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from tests.fixtures.mimo_v2_reference import read_checkpoint

    cfg = json.loads((model_dir / "config.json").read_text())["vision_config"]
    return {k: v for k, v in read_checkpoint(model_dir).items() if k.startswith("visual.")}, cfg


def embedding_split(
    model_dir: Path, img: Image.Image, epd_rows: torch.Tensor, vllm_rows: torch.Tensor
) -> dict[str, float]:
    from tests.fixtures.mimo_vit_reference import reference_tower

    tensors, cfg = tower(model_dir)
    h, w = grid_of(img)
    grid = [(1, h // 16, w // 16)]
    clip = release_mean_std(model_dir)

    def run(resize: str, mean_std: Any, norm: str) -> torch.Tensor:
        return reference_tower(pixels(img, resize, mean_std), grid, tensors, cfg, merger_norm=norm)

    release = run("bicubic", clip, "layer")
    return {
        "epd_vs_release_reference": rel(epd_rows, release),
        "vllm_vs_epd": rel(vllm_rows, epd_rows),
        "mean_std_only": rel(run("bicubic", IMAGENET, "layer"), release),
        "bilinear_only": rel(run("bilinear", clip, "layer"), release),
        "rms_merger_only": rel(run("bicubic", clip, "rms"), release),
        "all_three_vs_release": rel(run("bilinear", IMAGENET, "rms"), release),
        "all_three_vs_vllm_rows": rel(run("bilinear", IMAGENET, "rms"), vllm_rows),
    }


def sinks_dropped(model_dir: Path, img: Image.Image) -> float:
    """The release's windowed tower (tests.fixtures.mimo_vit) with and without its sinks."""
    from tests.fixtures import mimo_vit
    from tests.fixtures.mimo_vit_reference import reference_tower

    cfg = mimo_vit.tiny_mimo_vision_config()
    tensors = mimo_vit.tiny_mimo_vision_tensors(cfg, seed=0)
    h, w = grid_of(img)
    px = pixels(img, "bicubic", release_mean_std(model_dir))
    grid = [(1, h // 16, w // 16)]
    with_sinks = reference_tower(px, grid, tensors, cfg)
    without = reference_tower(
        px, grid, {k: v for k, v in tensors.items() if not k.endswith("attn.sinks")}, cfg
    )
    return rel(without, with_sinks)


# -- 2. greedy ids -------------------------------------------------------------------------------


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """(share of equal positions, the first that differs or None)."""
    same = [x == y for x, y in zip(a, b, strict=True)]
    return sum(same) / len(same), next((i for i, s in enumerate(same) if not s), None)


# -- 3. window -----------------------------------------------------------------------------------


def window_check(model_dir: Path, vllm_url: str, window: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    from llm_core.prompts.tokenizer import load_tokenizer
    from tests.fixtures.mimo_v2_reference import reference_model
    from tests.fixtures.qwen2_5_vl import CORPUS

    tok = load_tokenizer(str(model_dir))
    ids = tok.encode_text(" ".join(CORPUS * 8))[: 3 * window]
    assert len(ids) == 3 * window
    model = reference_model(model_dir)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    ref = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    out = _post(
        f"{vllm_url}/v1/completions",
        {"model": str(model_dir), "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
    )
    lp = out["choices"][0].get("prompt_logprobs") or out.get("prompt_logprobs")
    assert lp is not None, out
    got = [float(lp[i][str(ids[i])]["logprob"]) for i in range(1, len(ids))]
    diff = [abs(a - b) for a, b in zip(got, ref, strict=True)]
    first = next(i + 1 for i, d in enumerate(diff) if d > 1e-3)  # the prompt position of the token
    greedy = {}
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    for length in (window // 2, window - NEW_TOKENS, window, window + 1, 2 * window, 3 * window):
        prompt = ids[:length]
        with torch.no_grad():
            want = [int(t) for t in model.generate(torch.tensor([prompt]), generation_config=gen)[0, length:]]
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        have = _post(f"{vllm_url}/v1/completions", {**body, "return_token_ids": True})["choices"][0][
            "token_ids"
        ]
        greedy[str(length)] = agreement(list(have), want)[0]
    return {
        "window": window,
        # the first prompt token whose logprob differs: its query sits at position first - 1
        "first_differing_position": first,
        "max_abs_diff_before": max(diff[: first - 1]) if first > 1 else None,
        "abs_diff_at_first": diff[first - 1],
        "greedy_share_by_prompt_length": greedy,
    }


# -- the run -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--json", default="build/mimo_vllm_reference.json")
    args = parser.parse_args()

    from encoder.caches.embed_cache import EmbedCache
    from epd.llm_servers.vllm_launch import VLLMProcess
    from tests.fixtures.mimo_v2_vllm import WINDOW, write_tiny_mimo_v2_vllm
    from tests.fixtures.qwen2_5_vl import make_image
    from tests.fixtures.vllm_raw_tower import (
        captured_rows,
        chat_body,
        png_uri,
        raw_image_part,
        raw_tower_launch,
    )

    work = Path(tempfile.mkdtemp(prefix="mimo-vllm-ref-"))
    model_dir = write_tiny_mimo_v2_vllm(work / "ckpt", full_attention_tower=True)
    ec_dir = work / "ec"
    ec_dir.mkdir()
    launch = raw_tower_launch(model_dir, free_port(), ec_dir)
    port = free_port()
    epd_cmd = [
        *(sys.executable, "-m", "epd.cli", "serve", "--port", str(port), "--model", str(model_dir)),
        *("--llm-server", "vllm", "--llm-url", launch.url, "--encoder-dtype", "float32"),
    ]
    per_image: list[dict[str, Any]] = []
    with (
        VLLMProcess(launch, work / "vllm.log", ready_timeout_s=600) as vllm,
        ServiceProcess("epd serve", epd_cmd, f"http://127.0.0.1:{port}", work / "epd.log"),
    ):
        cache = EmbedCache(namespace=f"serve-{port}")
        for i, (w, h) in enumerate(SIZES[: args.images]):
            img = make_image(w, h, seed=100 + i)
            raw = _post(
                f"{vllm.url}/v1/chat/completions",
                chat_body(model_dir, raw_image_part(img, f"raw-{i}"), QUESTION, NEW_TOKENS),
            )
            part = {"type": "image_url", "image_url": {"url": png_uri(img)}}
            body = chat_body(model_dir, part, QUESTION, NEW_TOKENS)
            via_epd = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {**body, "model": None})
            entry = cache.get(via_epd["media"][0]["key"], touch=False)
            assert entry is not None
            epd_rows = entry.tensor.clone()
            assert via_epd["choices"][0]["prompt_token_ids"] == raw["prompt_token_ids"]
            share, first = agreement(via_epd["choices"][0]["token_ids"], raw["choices"][0]["token_ids"])
            row = {
                "size": [w, h],
                "tokens": int(epd_rows.shape[0]),
                "greedy_share": share,
                "first_differing": first,
            }
            row |= embedding_split(model_dir, img, epd_rows, captured_rows(ec_dir, f"raw-{i}"))
            row["sinks_dropped"] = sinks_dropped(model_dir, img)
            per_image.append(row)
            print(json.dumps(row))
        cache.close()
        window = window_check(model_dir, vllm.url, WINDOW)
        print(json.dumps(window))

    keys = [k for k in per_image[0] if k not in ("size", "tokens", "first_differing")]
    summary: dict[str, Any] = {f"mean_{k}": float(np.mean([r[k] for r in per_image])) for k in keys}
    summary |= {f"max_{k}": float(np.max([r[k] for r in per_image])) for k in keys}
    summary["window"] = window
    write_json(
        args.json,
        summary=summary,
        results=per_image,
        config={"images": args.images, "new_tokens": NEW_TOKENS},
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
