"""The checkpoint's chat template: found, rendered and expanded exactly as transformers does it.

Every rendering test compares with transformers on the same checkpoint directory: the tokenizer
(``AutoTokenizer``, which reads ``chat_template.jinja`` and ``tokenizer_config.json``) and the
processor (``AutoProcessor``, which reads ``chat_template.json``), so the file forms, their
precedence, the jinja environment and the special-token variables are all checked against the
reference rather than against our reading of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llm_core.prompts.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateFileError,
    load_chat_template,
)
from llm_core.prompts.tokenizer import ChatTemplateError as TokenizerChatTemplateError
from llm_core.prompts.tokenizer import save_default_tokenizer

# Written for these tests in the Qwen2-VL chat format. Block tags sit on their own lines so the
# output depends on trim_blocks / lstrip_blocks and the `-` modifiers being handled as transformers does.
QWEN2_VL_TEMPLATE = """\
{% set counts = namespace(images=0, videos=0) %}
{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['content'] is string %}
{{ message['content'] }}<|im_end|>
    {% else %}
        {% for part in message['content'] %}
            {% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}
                {% set counts.images = counts.images + 1 %}
                {% if add_vision_id %}Picture {{ counts.images }}: {% endif %}
<|vision_start|><|image_pad|><|vision_end|>
            {%- elif part['type'] == 'video' or 'video' in part %}
                {% set counts.videos = counts.videos + 1 %}
                {% if add_vision_id %}Video {{ counts.videos }}: {% endif %}
<|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in part %}
{{ part['text'] }}
            {%- endif %}
        {% endfor %}
<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

TOKENIZER_CONFIG: dict[str, Any] = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "add_bos_token": False,
    "model_max_length": 32768,
}

PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "min_pixels": 3136,
    "max_pixels": 100_000,
}

FORMS = ("jinja", "json", "tokenizer_config")


def write_checkpoint(
    directory: Path,
    form: str,
    template: Any,
    tokenizer_config: dict[str, Any] | None = None,
) -> Path:
    """A checkpoint directory with the byte-level tokenizer and the template in one file form."""
    directory.mkdir(parents=True, exist_ok=True)
    save_default_tokenizer(directory)
    config = dict(TOKENIZER_CONFIG if tokenizer_config is None else tokenizer_config)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    if form == "jinja":
        (directory / "chat_template.jinja").write_text(template)
    elif form == "json":
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    elif form == "tokenizer_config":
        config["chat_template"] = template
    else:
        raise AssertionError(form)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


Reference = Callable[..., str]


def reference(directory: Path, form: str) -> Reference:
    """transformers' rendering for the loader that reads this form's file."""
    from transformers import AutoProcessor, AutoTokenizer

    if form == "json":
        processor = AutoProcessor.from_pretrained(str(directory))
        return lambda messages, **kw: str(processor.apply_chat_template(messages, tokenize=False, **kw))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return lambda messages, **kw: str(tokenizer.apply_chat_template(messages, tokenize=False, **kw))


@pytest.fixture(scope="module")
def qwen_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ChatTemplate, Reference]]:
    out = {}
    for form in FORMS:
        directory = write_checkpoint(tmp_path_factory.mktemp(f"qwen2vl_{form}"), form, QWEN2_VL_TEMPLATE)
        ours = load_chat_template(directory)
        assert ours is not None
        out[form] = (ours, reference(directory, form))
    return out


IMAGE = {"type": "image"}
VIDEO = {"type": "video"}


def text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "text_only": ([{"role": "user", "content": "Hello there"}], {}),
    "multi_turn": (
        [
            {"role": "user", "content": [text("What is 2+2?")]},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And times 3?\nShow your work."},
        ],
        {},
    ),
    "system": (
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        {},
    ),
    "image_and_text": ([{"role": "user", "content": [IMAGE, text("Describe this image.")]}], {}),
    "two_images_and_video": (
        [
            {"role": "system", "content": [text("Be brief.")]},
            {"role": "user", "content": [IMAGE, text("versus"), IMAGE, VIDEO, text("What changed?")]},
        ],
        {},
    ),
    "no_generation_prompt": (
        [
            {"role": "user", "content": [IMAGE, text("Caption?")]},
            {"role": "assistant", "content": [text("A cat.")]},
        ],
        {"add_generation_prompt": False},
    ),
    "vision_ids_extra": (
        [{"role": "user", "content": [IMAGE, VIDEO, IMAGE, text("?")]}],
        {"add_vision_id": True},
    ),
    "openai_image_url_and_none_keys": (
        [
            {"role": "user", "name": None, "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": "ok", "tool_calls": None},
        ],
        {},
    ),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(CASES))
def test_renders_like_transformers(
    qwen_checkpoints: dict[str, tuple[ChatTemplate, Reference]], form: str, case: str
) -> None:
    ours, theirs = qwen_checkpoints[form]
    messages, kwargs = CASES[case]
    add_generation_prompt = kwargs.get("add_generation_prompt", True)
    extra = {k: v for k, v in kwargs.items() if k != "add_generation_prompt"}
    expected = theirs(messages, add_generation_prompt=add_generation_prompt, **extra)
    assert ours.render(messages, add_generation_prompt=add_generation_prompt, **extra) == expected


def test_qwen2_vl_format(qwen_checkpoints: dict[str, tuple[ChatTemplate, Reference]]) -> None:
    """The test template really is the Qwen2-VL format (so the parity above checks something real)."""
    ours, _ = qwen_checkpoints["jinja"]
    messages, _ = CASES["two_images_and_video"]
    assert ours.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>versus"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "What changed?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ours.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


# Everything transformers adds to plain jinja, in one template: special-token variables (named,
# AddedToken-valued, model-specific), tools/documents passed as None, the non-escaping tojson with
# its options, loopcontrols, strftime_now, namespace, dict, message normalization (None keys
# dropped, reasoning aliased), trim_blocks/lstrip_blocks and the dropped final newline.
ENV_TEMPLATE = """\
[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ image_token }}|{{ tools is none }}|{{ documents is none }}]
{{ messages | tojson }}
{{ messages[0] | tojson(indent=2, sort_keys=True) }}
{{ messages[1] | tojson(separators=(',', ':'), ensure_ascii=True) }}
{% for m in messages %}
    {% if loop.index0 == 2 %}{% break %}{% endif %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
<{{ m.role }}>
{% endfor %}
{% set ns = namespace(n=0) %}
{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}
{{ ns.n }} {{ dict(a=1, b=[1, 2]) | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}
{{ strftime_now('%Y') }} {{ custom | default('none') }}
    {% if add_generation_prompt %}
GEN
    {% endif %}
"""

ENV_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "<b>é & 'quotes'</b>", "name": None},
    {"role": "assistant", "content": "done", "reasoning": "because ✓"},
    {"role": "user", "content": [text("x")]},
]


@pytest.mark.parametrize("form", ["jinja", "tokenizer_config"])
def test_environment_matches_transformers(tmp_path: Path, form: str) -> None:
    directory = write_checkpoint(tmp_path, form, ENV_TEMPLATE)
    ours = load_chat_template(directory)
    assert ours is not None
    theirs = reference(directory, form)
    for extra in ({}, {"custom": "given", "eos_token": "<override>"}):
        for add_generation_prompt in (True, False):
            expected = theirs(ENV_MESSAGES, add_generation_prompt=add_generation_prompt, **extra)
            assert ours.render(ENV_MESSAGES, add_generation_prompt=add_generation_prompt, **extra) == expected
    assert '"thinking": "because ✓"' in expected and "&" in expected  # not vacuous


def test_processor_environment_matches_transformers(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path, "json", ENV_TEMPLATE)
    ours = load_chat_template(directory)
    assert ours is not None
    theirs = reference(directory, "json")
    # The processor (not the tokenizer) also turns OpenAI image_url parts into image parts; so do we.
    messages = [
        *ENV_MESSAGES,
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
    ]
    expected = theirs(messages, add_generation_prompt=True)
    assert ours.render(messages) == expected
    assert '{"type": "image", "url": "u"}' in expected


@pytest.mark.parametrize(
    "config",
    [
        TOKENIZER_CONFIG,
        {
            "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>"},
            "unk_token": "<|endoftext|>",
            "extra_special_tokens": {"vision_bos_token": "<|vision_start|>"},
            "added_tokens_decoder": {},
        },
    ],
)
def test_special_tokens_are_transformers_special_tokens_map(tmp_path: Path, config: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    directory = write_checkpoint(tmp_path, "jinja", "x", tokenizer_config=config)
    ours = load_chat_template(directory)
    assert ours is not None
    assert ours.special_tokens == AutoTokenizer.from_pretrained(str(directory)).special_tokens_map


def test_legacy_special_tokens_map(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    directory = write_checkpoint(tmp_path, "jinja", "{{ eos_token }}/{{ bos_token }}", tokenizer_config={})
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>", "lstrip": False}, "bos_token": "<|im_start|>"})
    )
    ours = load_chat_template(directory)
    assert ours is not None
    expected = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False
    )
    assert ours.render([{"role": "user", "content": "x"}]) == expected == "<|im_end|>/<|im_start|>"


# --- where the template comes from ---------------------------------------------------------


def test_precedence(tmp_path: Path) -> None:
    """processor_config.json > chat_template.json > chat_template.jinja > tokenizer_config.json."""
    from transformers import AutoProcessor, AutoTokenizer

    directory = write_checkpoint(tmp_path, "tokenizer_config", "T")
    msgs = [{"role": "user", "content": "x"}]

    def ours() -> str | None:
        t = load_chat_template(directory)
        return None if t is None else t.render(msgs)

    assert (
        ours()
        == "T"
        == AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(msgs, tokenize=False)
    )
    (directory / "chat_template.jinja").write_text("J")
    assert (
        ours()
        == "J"
        == AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(msgs, tokenize=False)
    )
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "S"}))
    assert ours() == "S" == AutoProcessor.from_pretrained(str(directory)).apply_chat_template(msgs)
    (directory / "processor_config.json").write_text(json.dumps({"chat_template": "P"}))
    assert ours() == "P" == AutoProcessor.from_pretrained(str(directory)).apply_chat_template(msgs)
    # A processor config without a template defers to the files.
    (directory / "processor_config.json").write_text(json.dumps({}))
    assert ours() == "S"


def test_no_template(tmp_path: Path) -> None:
    save_default_tokenizer(tmp_path)
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": None})
    )
    assert load_chat_template(tmp_path) is None


def test_named_templates_use_default(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    named = [
        {"name": "tool_use", "template": "U"},
        {"name": "default", "template": "D{{ messages | length }}"},
    ]
    directory = write_checkpoint(tmp_path, "tokenizer_config", named)
    ours = load_chat_template(directory)
    assert ours is not None
    msgs = [{"role": "user", "content": "x"}]
    assert (
        ours.render(msgs)
        == "D1"
        == AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(msgs, tokenize=False)
    )


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        (
            "tokenizer_config.json",
            {"chat_template": [{"name": "tool_use", "template": "U"}]},
            "no template named 'default'",
        ),
        ("tokenizer_config.json", {"chat_template": 7}, "must be a string or a list"),
        ("tokenizer_config.json", "{broken", "not valid JSON"),
        ("chat_template.json", {"template": "x"}, "no 'chat_template' key"),
        ("chat_template.json", "[1, 2]", "must hold a JSON object"),
        ("chat_template.jinja", "   \n", "empty"),
    ],
)
def test_unusable_template_file_names_the_file(tmp_path: Path, name: str, content: Any, match: str) -> None:
    save_default_tokenizer(tmp_path)
    (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(TemplateFileError, match=match) as ei:
        load_chat_template(tmp_path)
    assert str(tmp_path / name) in str(ei.value)
    assert ei.value.path == tmp_path / name


@pytest.mark.parametrize("form", FORMS)
def test_syntax_error_names_the_file_and_line(tmp_path: Path, form: str) -> None:
    broken = "{% for message in messages %}\n{{ message['role'] }\n{% endfor %}"
    directory = write_checkpoint(tmp_path, form, broken)
    file = {
        "jinja": "chat_template.jinja",
        "json": "chat_template.json",
        "tokenizer_config": "tokenizer_config.json",
    }
    with pytest.raises(TemplateFileError, match="does not compile") as ei:
        load_chat_template(directory)
    assert str(directory / file[form]) in str(ei.value)
    assert ei.value.lineno == 2 and "line 2" in str(ei.value)


# --- render errors are request errors ------------------------------------------------------

ALTERNATING = """\
{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{{ message['role'] }}: {{ message['content'] }}
{% endfor %}
"""


def jinja_template(tmp_path: Path, source: str) -> ChatTemplate:
    template = load_chat_template(write_checkpoint(tmp_path, "jinja", source))
    assert template is not None
    return template


def test_raise_exception_is_a_chat_template_error(tmp_path: Path) -> None:
    import jinja2
    from transformers import AutoTokenizer

    template = jinja_template(tmp_path, ALTERNATING)
    good = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert template.render(good) == "user: a\nassistant: b\nuser: c\n"
    bad = [*good[:2], {"role": "assistant", "content": "again"}, {"role": "user", "content": "d"}]
    with pytest.raises(ChatTemplateError) as ei:
        template.render(bad)
    assert ei.value.param == "messages[2]"
    message = str(ei.value)
    assert "chat_template.jinja line 3" in message and "roles must alternate" in message
    assert str(tmp_path) not in message  # a client sees the file name, not the server's paths
    # transformers rejects the same conversation (with jinja's TemplateError).
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(bad, tokenize=False)
    assert issubclass(ChatTemplateError, ValueError) and TokenizerChatTemplateError is ChatTemplateError


def test_type_error_in_template_names_the_message(tmp_path: Path) -> None:
    template = jinja_template(tmp_path, "{% for m in messages %}{{ m['content'] + '!' }}{% endfor %}")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}, {"role": "user", "content": [text("b")]}]
    with pytest.raises(ChatTemplateError, match="TypeError") as ei:
        template.render(msgs)
    assert ei.value.param == "messages[1]"


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{% set xs = [] %}{{ xs.append(1) }}", "SecurityError"),  # immutable sandbox
        ("{% set ns = namespace(_private=1) %}", "underscore"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ],
)
def test_sandbox_violations_are_chat_template_errors(tmp_path: Path, source: str, match: str) -> None:
    template = jinja_template(tmp_path, source)
    with pytest.raises(ChatTemplateError, match=match) as ei:
        template.render([{"role": "user", "content": "x"}])
    assert ei.value.param == "messages"  # fails whatever the messages: no message to blame


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "user", "content": "a"}, "not a message"], "messages[1]"),
        ("hi", "messages"),
    ],
)
def test_malformed_messages(tmp_path: Path, messages: Any, param: str) -> None:
    template = jinja_template(tmp_path, QWEN2_VL_TEMPLATE)
    with pytest.raises(ChatTemplateError) as ei:
        template.render(messages)
    assert ei.value.param == param
