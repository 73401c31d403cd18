"""Structure checks on the request record: the request is frozen, and no field of it or of the
scheduler's per-request state is annotated ``Any``."""

from __future__ import annotations

import dataclasses
import re

import pytest

from llm_core.request import Request, Sequence

ANY = re.compile(r"\bAny\b")


def _annotations(cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, ann in getattr(klass, "__annotations__", {}).items():
            out[name] = ann if isinstance(ann, str) else repr(ann)
    return out


@pytest.mark.parametrize("cls", [Request, Sequence])
def test_no_field_is_typed_any(cls: type) -> None:
    fields = _annotations(cls)
    assert fields, f"{cls.__name__} declares no fields"
    typed_any = {name: ann for name, ann in fields.items() if ANY.search(ann)}
    assert not typed_any, f"{cls.__name__} fields typed Any: {typed_any}"


def test_request_is_frozen_and_the_sequence_reads_it() -> None:
    req = Request.create("r", [1, 2, 3], max_new_tokens=4, stop_token_ids=[7])
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.max_new_tokens = 5  # type: ignore[misc]
    assert req.prompt_ids == (1, 2, 3) and req.stop_token_ids == frozenset({7})
    seq = Sequence.of(req)
    assert seq.request is req and seq.seq_id == "r" and seq.prompt_ids == [1, 2, 3]
    with pytest.raises(AttributeError):
        seq.max_new_tokens = 9  # type: ignore[misc]
    seq.output_ids.append(4)
    assert seq.token_ids == [1, 2, 3, 4] and req.prompt_ids == (1, 2, 3)


def test_the_runner_takes_one_scheduler_output() -> None:
    """``ModelRunner.execute``'s only input is the frozen ``SchedulerOutput``."""
    import inspect

    from llm_core.serving.model_runner import ModelRunner
    from llm_core.serving.scheduler_output import SchedulerOutput

    params = list(inspect.signature(ModelRunner.execute).parameters)
    assert params == ["self", "step"]
    assert ModelRunner.execute.__annotations__["step"] == "SchedulerOutput"
    seq = Sequence("s", [1, 2, 3])
    rows = [[0], [1]]
    out = SchedulerOutput.build([seq], [3], [rows])
    assert out.copies is None and out.page_rows == [rows]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.seqs = []  # type: ignore[misc]
    assert not any(ANY.search(a) for a in _annotations(SchedulerOutput).values())


def test_speculation_state_is_the_speculators() -> None:
    """Drafts and MTP progress live in ``Speculator.states`` by request id, not on the sequence."""
    from llm_core.serving.draft_state import DraftStates

    assert not {"draft_ids", "draft_probs", "mtp_start", "mtp_h0"} & set(_annotations(Sequence))
    states = DraftStates()
    states.of("r").draft_ids.extend([5, 6, 7])
    states.keep("r", 2)
    assert states.drafts("r") == [5, 6] and states.drafts("other") == []
    states.reset("r", 4)
    assert states.drafts("r") == [] and states.of("r").mtp_start == 4
    states.release("r")
    assert len(states) == 0


def test_kv_state_is_the_kv_managers() -> None:
    """Pages, pins and the prefix lock live in the KV manager by request id, not on the sequence:
    made at admission, read through ``of`` / ``rows``, gone once released and finished."""
    from llm_core.caches.kv_group_manager import FullAttentionManager
    from llm_core.caches.kv_manager import KVManager
    from llm_core.caches.page_pool import PagePool

    kv_fields = {
        "pages",
        "num_borrowed_pages",
        "num_released",
        "swa_pin_end",
        "swa_prompt_pin",
        "prefix_lock",
    }
    assert not kv_fields & set(_annotations(Sequence))
    kv = KVManager([FullAttentionManager(PagePool(32, 4, "full"))])
    seq = Sequence("r", list(range(10)))
    assert kv.rows(seq) == [] and kv.of(seq).num_pages == 0
    kv.match_prefix(seq)
    assert kv.allocate(seq, 10)
    kv.commit(seq, 10)
    assert len(kv.rows(seq)) == 1 and kv.of(seq).num_pages == 3
    kv.release(seq)
    kv.request_finished("r")
    assert kv.rows(seq) == [] and not kv._held
    kv.check_integrity([])


class _Import:
    """A copy-in source of a whole 8-token prompt (what a prefill engine's hand-off gives)."""

    end = 8
    first_token = 77

    def write(self, kv: object, rows: object, lo: int, hi: int) -> None:
        pass

    def write_layer(self, kv: object, layer: int, rows: object, lo: int, hi: int) -> None:
        pass


def test_kv_copied_in_is_kept_by_request_id_and_forgotten_at_the_end() -> None:
    """The import waits in the KV manager's import connector (not on the sequence) until
    admission hands it over as the copy-in source (kept in its transfers), is planned as the
    step's copy, and is gone once the request finished."""
    from llm_core.caches.kv_group_manager import FullAttentionManager
    from llm_core.caches.kv_manager import KVManager
    from llm_core.caches.page_pool import PagePool
    from llm_core.serving.scheduler import Scheduler, SchedulerConfig

    assert not {"kv_source", "kv_fetch", "kv_export"} & set(_annotations(Sequence))
    kv = KVManager([FullAttentionManager(PagePool(32, 4, "full"))])
    sched = Scheduler(SchedulerConfig(), kv)
    seq = Sequence("imp", list(range(1, 9)), max_new_tokens=1)
    sched.add(seq, _Import())  # type: ignore[arg-type]
    assert kv.imports.brings("imp") and kv.transfers.source("imp") is None  # asked at admission
    step = sched.schedule()
    assert kv.transfers.source("imp") is not None and not kv.imports.brings("imp")
    assert step is not None and step.copies is not None and step.num_new_tokens == [8]
    assert step.copies.out == [77]  # the import brings the token after the prompt
    assert sched.update(step, [77]) == [seq]
    assert len(kv.transfers) == 0


def test_kv_copied_in_or_out_goes_through_one_connector_interface() -> None:
    """The P/D hand-off (its import and its export), the host tier and the store tier are each a
    ``KVConnector``."""
    from llm_core.caches.kv_connector import HostTierConnector, KVConnector, PromptImports, StoreTierConnector
    from llm_core.serving.kv_handoff import KVHandoff

    for cls in (PromptImports, KVHandoff, HostTierConnector, StoreTierConnector):
        assert issubclass(cls, KVConnector), cls
