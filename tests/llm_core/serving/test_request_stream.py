"""RequestState / RequestStream: the text deltas of a request without stop strings (rendered when
read) are those of the incremental detokenizer run token by token; the output queue streams in
order and a consumer cancelled while waiting aborts its request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llm_core.prompts.tokenizer import Tokenizer, build_default_tokenizer
from llm_core.request import Sequence
from llm_core.serving.request_stream import OutputQueue, RequestState, RequestStream, StepOutput
from llm_core.serving.sampling import SamplingParams

TOK = Tokenizer(build_default_tokenizer())  # id b is byte b; 256.. are specials
EOS = 256
# "hé€!" as bytes, the 2- and 3-byte characters split over several ids, an eos (special: not
# shown), an id outside the vocabulary (shows nothing), a lone invalid byte (0xFF) and half a
# character at the end (shown as U+FFFD by the final flush)
IDS = [*b"h\xc3", 1000, *b"\xa9\xe2\x82", EOS, *b"\xac!", 0xFF, *b"ok\xc3"]


def publish(req: RequestState, ids: list[int], stop_ids: frozenset[int] = frozenset()) -> list[StepOutput]:
    """What the engine does with each sampled id (``LLMEngine._publish``); the last one ends it."""
    outs = []
    for k, tok in enumerate(ids):
        last = k == len(ids) - 1
        req.seq.output_ids.append(tok)
        assert not req.add_token(tok, render=tok not in stop_ids, last=last)
        outs.append(req.output([tok], finished=last, reason="length" if last else None))
    return outs


def reference_deltas(ids: list[int], stop_ids: frozenset[int] = frozenset()) -> list[str]:
    """The detokenizer run eagerly: each rendered id's delta, the flush with the last."""
    detok = TOK.detokenizer()
    deltas = []
    for k, tok in enumerate(ids):
        d = detok.add(tok) if tok not in stop_ids else ""
        deltas.append(d + (detok.flush() if k == len(ids) - 1 else ""))
    return deltas


def make_state(sampling: SamplingParams) -> RequestState:
    loop: Any = None  # outputs are not delivered here
    return RequestState.create(Sequence("r", [1, 2, 3]), sampling, TOK, loop)


@pytest.mark.parametrize("order", ["in order", "last first"])
def test_text_rendered_when_read_equals_the_eager_deltas(order: str) -> None:
    stop_ids = frozenset({EOS})
    req = make_state(SamplingParams(max_tokens=len(IDS)))
    outs = publish(req, IDS, stop_ids)
    assert req.detok.ids == []  # nothing was detokenized on the engine's side
    want = reference_deltas(IDS, stop_ids)
    assert "".join(want) == "hé€!\ufffdok\ufffd"
    read = outs if order == "in order" else outs[::-1]
    texts = {id(o): o.text for o in read}
    assert [texts[id(o)] for o in outs] == want
    assert [o.token_ids for o in outs] == [[t] for t in IDS]
    assert [o.num_output_tokens for o in outs] == list(range(1, len(IDS) + 1))
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not outs[0].finished


def test_stop_strings_keep_eager_rendering() -> None:
    """With stop strings the text is rendered as tokens arrive (the engine must see it): held back
    while a stop string may still form, the same text in the end."""
    req = make_state(SamplingParams(max_tokens=len(IDS), stop=("\x00never",)))
    outs = publish(req, IDS)
    assert req.detok.ids  # rendered on the engine's side
    assert "".join(o.text for o in outs) == "".join(reference_deltas(IDS))
    assert outs[0].text == ""  # held back: it may be the start of the stop string


@pytest.mark.parametrize("stop", [(), ("\x00never",)])
def test_an_aborted_request_ends_with_no_new_text(stop: tuple[str, ...]) -> None:
    """An abort flushes nothing: the half character held back is dropped, rendered lazily or not."""
    req = make_state(SamplingParams(max_tokens=8, stop=stop))
    outs = []
    for tok in b"ab\xc3":
        req.seq.output_ids.append(tok)
        assert not req.add_token(tok, render=True, last=False)
        outs.append(req.output([tok], finished=False, reason=None))
    end = req.output([], finished=True, reason="abort")
    assert "".join(o.text for o in outs) + end.text == "ab"
    assert end.finished and end.finish_reason == "abort" and end.token_ids == []


def test_output_queue_streams_in_order_and_cancel_aborts() -> None:
    async def main() -> None:
        queue = OutputQueue(asyncio.get_running_loop())
        aborted: list[str] = []
        stream = RequestStream("r", queue, aborted.append)
        outs = [
            StepOutput("r", [i], str(i), i == 2, "stop" if i == 2 else None, 3, i + 1, 0) for i in range(3)
        ]
        queue.put_nowait(outs[0])
        assert await anext(stream) is outs[0]  # already there: no wait
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert not waiting.done()
        queue.put_nowait(outs[1])
        assert await waiting is outs[1]
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert aborted == ["r"]  # the client went away while waiting
        queue.put_nowait(outs[2])
        assert queue.get_nowait() is outs[2]  # a put after the cancel is still in order

        finishing = RequestStream("s", OutputQueue(asyncio.get_running_loop()), aborted.append)
        finishing._queue.put_nowait(outs[2])
        assert [o async for o in finishing] == [outs[2]]
        finishing.close()
        assert aborted == ["r"]  # closing a finished stream aborts nothing

    asyncio.run(main())
