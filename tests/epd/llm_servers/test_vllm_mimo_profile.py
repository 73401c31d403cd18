"""MiMo-V2.5 behind vLLM without a vLLM (the `vllm`-marked side: ``test_vllm_mimo_e2e``): the
family's launch profile in the registry (``epd_common/checkpoint/vllm_profile.py``) read by the
launcher, the start-up check's architecture names, and the 415 for videos and audio before anything
is sent."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from epd.cli import build_parser
from epd.llm_servers.vllm_embeds import EmbeddingGeometry
from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMLaunchError, launch_profile
from epd.llm_servers.vllm_server import ModelInfo, VLLMServer
from epd.media_pipeline import EncodedItem
from epd.prompt_format import PromptFormat
from epd.serve_cmd import config_from_args, vllm_child
from epd_common.checkpoint.registry import find_architecture, vllm_profile
from epd_common.checkpoint.vllm_profile import DEFAULT_VLLM, EMBEDS_ONLY, MIMO_V25_VLLM
from epd_common.errors import APIError
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.prompts.media_parts import UnservedModality
from llm_core.prompts.tokenizer import load_tokenizer


def _argv(model_dir: Path, *extra: str) -> list[str]:
    return VLLMLaunch(str(model_dir), 8123, python=sys.executable, extra_args=extra).argv()


def test_the_registry_row_carries_the_profile(mimo_v2_vllm_dir: Path) -> None:
    raw = json.loads((mimo_v2_vllm_dir / "config.json").read_text())
    assert vllm_profile(raw) is MIMO_V25_VLLM
    assert vllm_profile({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}) is DEFAULT_VLLM
    assert vllm_profile({"architectures": ["SomethingElse"]}) is DEFAULT_VLLM
    # the class vLLM loads it as is the same row (a config.json saved under that name)
    omni = find_architecture({"architectures": ["MiMoV2OmniForCausalLM"]})
    assert omni is not None and omni is find_architecture(raw) and omni.name == "MiMoV2ForCausalLM"


def test_a_mimo_vllm_gets_remote_code_and_embeddings_only(mimo_v2_vllm_dir: Path, qwen_dir: Path) -> None:
    argv = _argv(mimo_v2_vllm_dir)
    assert "--trust-remote-code" in argv and "--enable-mm-embeds" in argv
    limits = json.loads(argv[argv.index("--limit-mm-per-prompt") + 1])
    assert limits == {"image": 0, "video": 0, "audio": 0}
    # config.json's rope_theta, whatever the checkpoint's config class keeps under transformers 5
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"rope_theta": 10_000_000.0}
    # --vllm-arg words come after the profile's: vLLM takes the last
    argv = _argv(mimo_v2_vllm_dir, "--limit-mm-per-prompt", '{"image": 1}')
    assert argv.index(EMBEDS_ONLY) < len(argv) - 1 and argv[-1] == '{"image": 1}'
    # another family gets none of it, nor a path whose config.json is not readable here
    for other in (qwen_dir, Path("/no/such/dir")):
        argv = _argv(other)
        assert not {"--trust-remote-code", "--limit-mm-per-prompt", "--hf-overrides"} & set(argv)


def test_the_config_module_must_be_there(mimo_v2_vllm_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "mimo"
    shutil.copytree(mimo_v2_vllm_dir, bare)
    (bare / "configuration_mimo_v2.py").unlink()
    with pytest.raises(VLLMLaunchError, match=r"configuration_mimo_v2\.py"):
        launch_profile(bare)
    args = ["serve", "--model", str(bare), "--llm-server", "vllm", "--vllm-python", sys.executable]
    cfg = config_from_args(build_parser(only="serve").parse_args(args))
    with pytest.raises(SystemExit, match=r"configuration_mimo_v2\.py"):
        vllm_child(cfg, 8123)


def test_the_start_up_check_takes_the_name_vllm_loads_it_as(mimo_v2_vllm_dir: Path) -> None:
    info = ModelInfo.of(mimo_v2_vllm_dir)
    assert info.architecture == "MiMoV2ForCausalLM" and info.geometry == (2, 128)
    assert info.profile is MIMO_V25_VLLM
    assert info.same_architecture("MiMoV2ForCausalLM") and info.same_architecture("MiMoV2OmniForCausalLM")
    assert not info.same_architecture("Qwen2_5_VLForConditionalGeneration")
    qwen = ModelInfo("Qwen2_5_VLForConditionalGeneration", EmbeddingGeometry(2, 128))
    assert not qwen.same_architecture("MiMoV2OmniForCausalLM")


def _messages(kind: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": kind, kind: "x"}, {"type": "text", "text": "hi"}]}]


def test_videos_and_audio_are_refused_before_anything_is_sent(mimo_v2_vllm_dir: Path) -> None:
    info = ModelInfo.of(mimo_v2_vllm_dir)
    fmt = PromptFormat.load(mimo_v2_vllm_dir, load_tokenizer(mimo_v2_vllm_dir))
    only = fmt.only(info.profile.embeds, VLLMServer.name, info.profile.refused_because)
    only.check_parts(_messages("image"))
    for kind in ("video", "audio"):
        with pytest.raises(UnservedModality) as exc:
            only.check_parts(_messages(kind))
        assert exc.value.param == "messages[0].content[0]"
        assert f"vllm LLM server does not take {kind} input" in str(exc.value)
        assert "vLLM 0.32 takes no embeddings for video or audio" in str(exc.value)

    # and the backend itself refuses such an item if one got past the ingress
    backend = VLLMServer(only, info, cache=None, route="chat")
    ref = EmbeddingRef(key="k" * 64, dtype="float32", shape=(4, 128), grid_thw=((2, 2, 4),), modality="video")
    with pytest.raises(APIError) as err:
        asyncio.run(backend.chat_call([], [EncodedItem("messages[0].content[0]", ref, False)], {}))
    assert err.value.status == 415 and "video" in err.value.message
