"""The encoder-cache transport to vLLM (epd/llm_servers/vllm_ec.py, ``--vllm-ec-path``): embeddings
as ``DIR/<MediaKey>/encoder_cache.safetensors`` for vLLM's ``ECExampleConnector``, the request only
grids and uuids. The folder's writes, checks and size bound without vLLM; then one real vLLM (the CPU
build, ``vllm``-marked) started as an encoder-cache consumer: the greedy ids equal the inline path's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from epd.config import IngressConfig
from epd.llm_servers.base import ServerMismatch
from epd.llm_servers.vllm_ec import ECFolder, metadata_keys, metadata_part, read_header
from epd.llm_servers.vllm_embeds import EmbeddingGeometry
from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMProcess, free_port, peer_python
from epd.llm_servers.vllm_server import ModelInfo, VLLMClient, VLLMServer
from epd.media_pipeline import EncodedItem
from epd_common.errors import APIError
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.prompts.tokenizer import Tokenizer, build_default_tokenizer

GEO = EmbeddingGeometry(merge=2, hidden=8)


def ref(
    key: str, grid: tuple[int, int, int] = (1, 4, 6), modality: str = "image", hidden: int = 8
) -> EmbeddingRef:
    rows = grid[0] * grid[1] * grid[2] // 4
    seconds = 2.0 if modality == "video" else None
    return EmbeddingRef(key, "float32", (rows, hidden), (grid,), modality, seconds_per_grid_t=seconds)


class FakeCache:
    """The node cache as the backend reads it: ``get`` (counted) and ``evict``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.gets = 0

    def get(self, key: str) -> Any:
        self.gets += 1
        return SimpleNamespace(tensor=self.tensors[key]) if key in self.tensors else None

    def evict(self, key: str) -> None:
        self.tensors.pop(key, None)


def old(path: Path, age_s: float) -> None:
    t = time.time() - age_s
    os.utime(path, (t, t))


# -- the folder ----------------------------------------------------------------------------------
def test_write_then_reuse_and_a_wrong_file_is_replaced(tmp_path: Path) -> None:
    folder = ECFolder(tmp_path / "ec")
    r, emb = ref("k1"), torch.randn(6, 8)
    assert not folder.has(r, GEO)
    assert folder.write(r, emb)
    path = tmp_path / "ec" / "k1" / "encoder_cache.safetensors"
    assert torch.equal(load_file(str(path))["ec_cache"], emb)  # what vLLM loads
    assert read_header(path) == ("F32", [6, 8]) and folder.has(r, GEO)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    save_file({"ec_cache": torch.zeros(5, 8)}, str(path))  # one row short: vLLM would die on it
    assert not folder.has(r, GEO)
    path.write_bytes(path.read_bytes()[:-4])  # truncated
    assert read_header(path) is None and not folder.has(r, GEO)
    assert folder.write(r, emb) and folder.has(r, GEO)


def test_prune_deletes_oldest_unused_never_what_is_in_use(tmp_path: Path) -> None:
    folder = ECFolder(tmp_path, max_bytes=1, grace_s=100.0)
    for i, age in enumerate([500.0, 400.0, 300.0]):
        (tmp_path / f"k{i}").mkdir()
        save_file({"ec_cache": torch.zeros(6, 8)}, str(tmp_path / f"k{i}" / "encoder_cache.safetensors"))
        old(tmp_path / f"k{i}" / "encoder_cache.safetensors", age)
    (tmp_path / "recent").mkdir()  # written by another ingress a moment ago: its mtime protects it
    save_file({"ec_cache": torch.zeros(6, 8)}, str(tmp_path / "recent" / "encoder_cache.safetensors"))
    (tmp_path / "vllm-made").mkdir()  # vLLM creates a folder for every item it is asked about
    old(tmp_path / "vllm-made", 500.0)
    folder.mark_used(["k2"])  # an old file this process is sending now
    folder.prune(now=time.time())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k2", "recent"]
    # with no budget (0) nothing is ever deleted
    keep = ECFolder(tmp_path / "keep", max_bytes=0, grace_s=0.0)
    assert keep.write(ref("a"), torch.zeros(6, 8)) and (tmp_path / "keep" / "a").is_dir()


def test_the_metadata_part_and_a_vanished_file_never_reaches_vllm(tmp_path: Path) -> None:
    folder = ECFolder(tmp_path)
    v = ref("vid", (2, 4, 4), "video")
    part = metadata_part(v)
    assert part["uuid"] == "vid" and part["video_embeds"]["video_grid_thw"] == [2, 4, 4]
    assert "video_embeds" not in part["video_embeds"] and "second_per_grid_ts" in part["video_embeds"]
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}
    assert metadata_keys(body) == ["vid"]
    client = VLLMClient(None, "http://x")  # type: ignore[arg-type]
    client.ec = folder
    with pytest.raises(APIError, match="removed") as err:
        client.prepare(body)  # vLLM's engine dies on a metadata-only part without its file
    assert err.value.status == 502
    assert folder.write(v, torch.zeros(8, 8))
    assert client.prepare(body)["messages"] == body["messages"]


def test_chat_call_writes_checks_and_falls_back_inline(tmp_path: Path) -> None:
    cache = FakeCache({"good": torch.randn(6, 8), "short": torch.randn(5, 8)})
    info = ModelInfo("Qwen2_5_VLForConditionalGeneration", GEO)
    backend = VLLMServer(None, info, cache, ec=ECFolder(tmp_path))  # type: ignore[arg-type]
    # the chat route looks for spelled specials in the text: the embedded tokenizer is enough here
    backend.prompt_format = SimpleNamespace(tokenizer=Tokenizer(build_default_tokenizer()))  # type: ignore[assignment]
    good = ref("good")

    def call(*refs: EmbeddingRef) -> list[dict[str, Any]]:
        items = [EncodedItem(f"image[{i}]", r, False) for i, r in enumerate(refs)]
        msgs = [{"role": "user", "content": [{"type": "image", "index": i} for i in range(len(refs))]}]
        out = asyncio.run(backend.chat_call(msgs, items, {}))
        return list(out.body["messages"][0]["content"])

    (part,) = call(good)
    assert part == metadata_part(good) and (tmp_path / "good" / "encoder_cache.safetensors").exists()
    gets = cache.gets
    assert call(good) == [part] and cache.gets == gets  # in place: not read again
    forged = EmbeddingRef("short", "float32", (5, 8), ((1, 4, 6),))  # rows disagree with the grid
    with pytest.raises(APIError, match="does not fit") as err:
        call(good, forged)
    assert err.value.status == 502 and not (tmp_path / "short").exists() and "short" not in cache.tensors
    backend.ec = ECFolder(tmp_path / "blocked")
    (tmp_path / "blocked" / "good").write_bytes(b"")  # a file where the item's folder goes: no write
    (inline,) = call(good)
    assert inline["image_embeds"]["image_embeds"] and inline["uuid"] == "good-inline"


def test_flags_and_launch() -> None:
    cfg = IngressConfig(vllm_ec_path="/dev/shm/ec", request_timeout_s=30.0)
    launch = VLLMLaunch("/ckpt", 8123, python="py", ec_path=cfg.vllm_ec_path)
    argv = launch.argv()
    config = json.loads(argv[argv.index("--ec-transfer-config") + 1])
    assert config == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": "/dev/shm/ec"},
    }
    assert "--ec-transfer-config" not in VLLMLaunch("/ckpt", 8123, python="py").argv()  # inline default
    assert ECFolder.of(IngressConfig()) is None


# -- against a real vLLM -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ec_vllm(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMProcess, Path]]:
    ec = (
        Path("/dev/shm" if os.path.isdir("/dev/shm") else tmp_path_factory.mktemp("ec"))
        / f"epd-ec-{os.getpid()}"
    )
    launch = VLLMLaunch(str(qwen_dir), free_port(), kv_cache_gib=1, ec_path=str(ec))
    server = VLLMProcess(launch, tmp_path_factory.mktemp("vllm_ec") / "vllm.log", ready_timeout_s=600)
    ECFolder(ec)  # the folder exists before vLLM starts
    with server:
        yield server, ec
    for d in ec.iterdir():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    ec.rmdir()


@pytest.mark.vllm
@pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)")
def test_ids_equal_the_inline_path(ec_vllm: tuple[VLLMProcess, Path], qwen_dir: Path, tmp_path: Path) -> None:
    """One vLLM, an encoder-cache consumer of ``ec``: an image and a video (2 s per temporal patch)
    inline, then by file (written), then by file again (in place, not read from the cache)."""
    server, ec = ec_vllm
    from epd.prompt_format import PromptFormat
    from llm_core.prompts.tokenizer import load_tokenizer

    info = ModelInfo.of(qwen_dir)
    fmt = PromptFormat.load(qwen_dir, load_tokenizer(str(qwen_dir)))
    hidden = info.geometry.hidden
    g = torch.Generator().manual_seed(0)
    image, video = torch.randn(24, hidden, generator=g) * 0.5, torch.randn(32, hidden, generator=g) * 0.5
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "index": 0},
                {"type": "video", "index": 1},
                {"type": "text", "text": "What happens here?"},
            ],
        }
    ]

    def items(prefix: str) -> list[EncodedItem]:
        refs = [
            ref(f"{prefix}img", (1, 8, 12), hidden=hidden),
            ref(f"{prefix}vid", (2, 8, 8), "video", hidden),
        ]
        return [EncodedItem(f"item[{i}]", r, False) for i, r in enumerate(refs)]

    async def run() -> tuple[list[list[int]], str]:
        async with aiohttp.ClientSession() as session:
            inline = VLLMServer(fmt, info, FakeCache({"aimg": image, "avid": video}))  # type: ignore[arg-type]
            cache = FakeCache({"bimg": image, "bvid": video})
            via_ec = VLLMServer(fmt, info, cache, ec=ECFolder(ec))  # type: ignore[arg-type]
            wrong = VLLMServer(fmt, info, None, ec=ECFolder(tmp_path / "not-read"))
            ids = []
            for backend, prefix in [(inline, "a"), (via_ec, "b"), (via_ec, "b")]:
                client = backend.client(session, server.url, 60.0)
                await backend.check_server(client)  # with a folder: vLLM must read it
                call = await backend.chat_call(messages, items(prefix), {"max_tokens": 16, "temperature": 0})
                body = {**call.body, "return_token_ids": True}
                ids.append((await client.complete(body, path=call.path))["choices"][0]["token_ids"])
            assert cache.gets == 2  # the second call found both files in place
            with pytest.raises(ServerMismatch, match="does not read the encoder-cache folder") as err:
                await wrong.check_server(wrong.client(session, server.url, 60.0))
            return ids, str(err.value)

    (inline_ids, ec_ids, again_ids), _ = asyncio.run(run())
    assert (ec / "bimg" / "encoder_cache.safetensors").exists() and not (
        ec / "aimg" / "encoder_cache.safetensors"
    ).exists()
    assert len(inline_ids) == 16 and ec_ids == inline_ids and again_ids == inline_ids
    assert server.alive and server.healthy()


def test_serve_starts_vllm_as_a_consumer_of_the_folder(qwen_dir: Path) -> None:
    from epd.cli import build_parser
    from epd.serve_cmd import config_from_args, plan

    argv = ["serve", "--model", str(qwen_dir), "--llm-server", "vllm", "--vllm-python", "py"]
    args = build_parser(only="serve").parse_args(
        [*argv, "--vllm-ec-path", "/dev/shm/ec", "--vllm-ec-max-bytes", "1024"]
    )
    p = plan(config_from_args(args))
    child = next(c for c in p.children if c.name == "vllm")
    config = json.loads(child.argv[child.argv.index("--ec-transfer-config") + 1])
    assert config["ec_connector_extra_config"] == {"shared_storage_path": "/dev/shm/ec"}
    assert (p.ingress.vllm_ec_path, p.ingress.vllm_ec_max_bytes) == ("/dev/shm/ec", 1024)
    inline = plan(config_from_args(build_parser(only="serve").parse_args(argv)))
    assert "--ec-transfer-config" not in next(c for c in inline.children if c.name == "vllm").argv


def test_the_folder_must_be_this_users_own_and_closed(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ValueError, match="chmod 700"):
        ECFolder(open_dir)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="not a directory"):
        ECFolder(link)
    ECFolder(real)  # its own, 0700: accepted


def test_writes_follow_no_planted_link(tmp_path: Path) -> None:
    """A link planted under a key (to a file or folder elsewhere) is never written through: it is
    replaced by a real folder, and what it pointed at is untouched."""
    root = tmp_path / "ec"
    folder = ECFolder(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "good").symlink_to(elsewhere)
    assert folder.write(ref("good"), torch.zeros(6, 8))
    assert not (root / "good").is_symlink() and (root / "good" / "encoder_cache.safetensors").is_file()
    assert list(elsewhere.iterdir()) == []
    # a link where the file goes is replaced by the rename, not followed
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    (root / "good" / "encoder_cache.safetensors").unlink()
    (root / "good" / "encoder_cache.safetensors").symlink_to(target)
    assert folder.write(ref("good"), torch.zeros(6, 8))
    assert target.read_bytes() == b"keep" and not (root / "good" / "encoder_cache.safetensors").is_symlink()


def test_a_name_cannot_pin_what_does_not_exist(tmp_path: Path) -> None:
    folder = ECFolder(tmp_path / "ec")
    assert not folder.mark_used(["../../etc", "f" * 64, "not a key"])
    assert folder._used == {}
    assert folder.write(ref("good"), torch.zeros(6, 8))
    assert folder.mark_used(["good"]) and set(folder._used) == {"good"}
