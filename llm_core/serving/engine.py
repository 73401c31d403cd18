"""LLMEngine: continuous batching on a dedicated thread, streamed to asyncio callers.

    event loop (server)                              engine thread
    ───────────────────                              ─────────────
    submit(): validate, build Sequence,              loop:  [lock] drain aborts, schedule
              [lock] scheduler.add ─────────────▶           runner.execute (no lock: the forward)
    abort():  abort deque ──────────────────────▶           [lock] scheduler.update, StepOutputs
    RequestStream ◀── OutputQueue ◀── call_soon_threadsafe (one hop per loop per step)

The thread alone runs the model and touches the KV tensors. The scheduler is shared with
``submit`` under one lock that is never held during the forward, so a submit waits for at most a
schedule or update, never a whole step; torch releases the GIL inside kernels, so the event loop
stays responsive while a step runs. Admission is by expected wait (``admission.py``): ``submit``
raises ``EngineOverloaded`` (the server answers 503, Retry-After = the wait) when the request's
first token would not come within its deadline, from the tokens of work waiting ahead and its
prompt at the tokens per busy second the engine has been serving; ``max_waiting`` requests
waiting is a memory guard. Requests
that can never fit raise ``EngineRequestError`` before any streaming.

Detokenization, stop strings and the thread-to-loop hand-off live in ``request_stream.py``. The
engine knows nothing of HTTP; it speaks token ids, ``SamplingParams`` and ``MultimodalInput``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from epd_common.admission import admission_bound_s, bound_text
from epd_common.messages.cache_keys import MediaRows, MediaSpanError, media_spans
from epd_common.messages.completion_response import KVTransferReport
from epd_common.messages.kv_events import AllBlocksCleared, KVEventBatch
from epd_common.store.store import Store
from llm_core.caches.host_tier import HostKVTier
from llm_core.caches.kv_manager import KVManager, group_managers
from llm_core.caches.kv_pool import KVCacheConfig, KVLayout, PagedKVCache
from llm_core.caches.kv_store_tier import KVStoreTier, model_kv_id
from llm_core.kv_transfer.kv_import import KVImport
from llm_core.models.config import DecoderConfig
from llm_core.models.mtp import MTPHeads
from llm_core.models.positions import PositionScheme
from llm_core.prompts.tokenizer import Tokenizer
from llm_core.request import MultimodalInput, Request, Sampled
from llm_core.request import Sequence as Seq
from llm_core.serving.admission import EngineAdmission
from llm_core.serving.engine_stats import EngineLoad, EngineStats, ThroughputMeter
from llm_core.serving.kv_event_publisher import KVEventPublisher
from llm_core.serving.kv_handoff import KVHandoff
from llm_core.serving.model_runner import CausalLM, ModelRunner
from llm_core.serving.request_stream import RequestState, RequestStream, StepOutput
from llm_core.serving.request_stream import deliver as deliver_outputs
from llm_core.serving.sampling import Sampler, SamplingParams
from llm_core.serving.scheduler import QueueFull, Scheduler, SchedulerConfig, SchedulerError
from llm_core.serving.server_config import EngineConfig
from llm_core.serving.speculative import Speculator
from llm_core.serving.step_cost import StepCost

log = logging.getLogger(__name__)

# Within a burst (a second request came within ``burst_quiet_ms`` of the first), the quiet that ends
# the gather is this many times ``burst_quiet_ms``: a closed-loop client opening a connection per
# request spaced a wave of 32 by gaps over a millisecond now and then, and with 1 ms the first step
# took 1-7 of its prompts in 2 of 4 waves (TTFT P50 at the second step's end).
BURST_QUIET_FACTOR = 3.0


class EngineRequestError(ValueError):
    """A request the engine cannot run (bad media alignment, too long); ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        self.param = param
        super().__init__(message)


class EngineOverloaded(RuntimeError):
    """The request would wait past its deadline ("wait") or the waiting queue is at its guard
    ("memory"); retry after ``retry_after_s`` (the expected wait)."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "wait") -> None:
        self.retry_after_s = retry_after_s
        self.reason = reason
        super().__init__(message)


class LLMEngine:
    """Owns the scheduler, the KV cache and the model runner; serves many concurrent requests."""

    def __init__(
        self,
        model: CausalLM,
        model_config: DecoderConfig,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        positions: PositionScheme | None = None,
        kv_events: KVEventPublisher | None = None,
        mtp: MTPHeads | None = None,
    ) -> None:
        """``positions``: the model family's rotary position scheme (``LoadedLLM.positions``);
        None: token i at position i. ``kv_events``: where the prefix cache's changes are published
        (the engine owns it from here: ``stop`` closes it). ``mtp``: the checkpoint's
        multi-token-prediction heads (``LoadedLLM.mtp``), for ``speculative_steps`` > 0."""
        self.config = config or EngineConfig()
        k = self.config.speculative_steps
        if k and (mtp is None or len(mtp.heads()) < k):
            have = 0 if mtp is None else len(mtp.heads())
            raise ValueError(
                f"speculative_steps={k} needs {k} MTP heads; the checkpoint has {have} "
                "(num_nextn_predict_layers / model.mtp.layers.*)"
            )
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_model_len = self.config.max_model_len or model_config.max_position_embeddings
        # End of generation: the model's eos, the tokenizer's, and ChatML's end of turn (as in
        # Qwen-style generation configs), unless a request sets ignore_eos.
        self.eos_token_ids: frozenset[int] = frozenset(
            t
            for t in (model_config.eos_token_id, tokenizer.eos_token_id, tokenizer.im_end_token_id)
            if t is not None
        )
        self.kv, self.scheduler = _build_kv_and_scheduler(
            model_config, self.config, self.max_model_len, self.device, dtype, kv_events is not None, k
        )
        # Changes at each restart: a router that sees a new id drops what it knew of this engine.
        self.instance_id = uuid.uuid4().hex[:16]
        self.kv_events = kv_events
        # Prefill/decode disaggregation (set by the server): the KV exports of finished prefills,
        # by request id, until the server puts them in the response.
        self._handoff: KVHandoff | None = None
        self.handoff = None
        # The checkpoint directory (``from_checkpoint``): names the weights in KV store keys.
        self.model_dir: Path | None = None
        # M-RoPE (dims 3) places each image or video as one grid: one placeholder run per item
        self._one_run_per_item = positions is not None and positions.dims == 3
        if kv_events is not None:
            kv_events.publish(KVEventBatch(time.time(), (AllBlocksCleared(),)))
        self.runner = ModelRunner(
            model,
            self.kv,
            Sampler(self.config.seed, self.device),
            self.device,
            positions,
            vocab_size=model_config.vocab_size,
            kv_copy_overlap=self.config.kv_copy_overlap,
        )
        if k:
            assert mtp is not None
            mtp.after_load(model.backends)  # the target's backends (serving only: never trained here)
            self.runner.speculator = Speculator(mtp, model, self.kv, k, self.runner.sampling)  # type: ignore[arg-type]
            self.scheduler.drafts = self.runner.speculator.states  # the drafts, by request id
        # Guards the scheduler and ``_requests`` between the event loop (add) and the step thread
        # (schedule/update). Never held during the forward, so adds do not wait for a step.
        self._lock = threading.Lock()
        self._aborts: collections.deque[str] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._requests: dict[str, RequestState] = {}
        self._meter = ThroughputMeter()
        transfers, imports = self.scheduler.kv.transfers, self.scheduler.kv.imports
        self.admission = EngineAdmission(
            self.config.admission_seed_tokens_per_s,
            copied_in=lambda s: transfers.source(s.seq_id) is not None or imports.brings(s.seq_id),
        )
        self._expected_wait_s = 0.0  # the last estimate (a gauge)
        self._busy_since: float | None = None  # end of the last busy step (None after idling)
        self._refusals: collections.Counter[str] = collections.Counter()
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0
        self._steps = 0

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the step thread; unfinished requests end with finish_reason "abort"."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                # a step is still running (a long forward): closing the transports and the store
                # under it would fail that step mid-write; the thread ends at its next stop check
                log.warning("engine step thread still running after %.1f s; resources left open", timeout_s)
                return
            self._thread = None
        if self.kv_events is not None:
            self.kv_events.close()
        if self.handoff is not None:
            self.handoff.close()
        host = self.scheduler.kv.host_tier
        if host is not None and host.store is not None:
            host.store.flush(timeout_s=2.0)  # pages queued for the store: a short grace, not a wait
            host.store.close()

    # ---- requests (called from the event loop) -----------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        mm: Sequence[MultimodalInput] = (),
        request_id: str | None = None,
        *,
        kv_import: KVImport | None = None,
        kv_export: bool = False,
        deadline_s: float | None = None,
    ) -> RequestStream:
        """Queue a request and return its output stream.

        ``kv_import``: the prompt's KV from a prefill engine (copied in, not computed);
        ``kv_export``: hand the prompt's KV to ``handoff`` when its prefill completes
        (``pop_export`` has the handle once the request finished). ``deadline_s``: the client's
        timeout (admission uses the shorter of it and ``max_queue_wait_s``).

        Raises ``EngineRequestError`` (bad request) or ``EngineOverloaded`` (it would wait past its
        deadline, or the queue is at its guard) right away, so the server can answer with a status
        before any streaming starts. Must be called from a running event loop; outputs flow once
        ``start()`` has been called.
        """
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        request = self._build_request(rid, list(prompt_ids), sampling, mm, deadline_s, kv_export)
        if kv_export and self.handoff is None:
            raise EngineRequestError("this engine has no KV transport to export with", "kv_transfer")
        seq = Seq.of(request)
        req = RequestState.create(seq, sampling, self.tokenizer, loop)
        cfg = self.config
        deadline = cfg.max_queue_wait_s if deadline_s is None else min(deadline_s, cfg.max_queue_wait_s)
        bound = admission_bound_s(deadline)  # the first token's way out is not in the estimate
        with self._lock:
            est = self.admission.estimate(self.scheduler.waiting, seq, kv_import is not None)
            # A prompt that alone outlasts the deadline is judged by its start, or it could never
            # be taken while anything else runs.
            wait = est.wait_s if est.wait_s - est.start_s <= bound else est.start_s
            self._expected_wait_s = wait
            held_any = bool(self._requests)
            if held_any and wait > bound:  # an idle engine takes anything that fits
                self._refusals["wait"] += 1
                raise EngineOverloaded(
                    f"expected wait {wait:.1f} s for the first token ({est.tokens_ahead:.0f} tokens of"
                    f" work waiting ahead and {est.prompt_own:.0f} of its prompt at"
                    f" {est.tokens_per_s:.0f} tokens/s; x{est.correction:.2f} for how late recent"
                    f" requests were) exceeds {bound_text(deadline)}",
                    retry_after_s=wait * est.retry_scale,
                )
            if self.scheduler.num_waiting >= cfg.max_waiting:
                self._refusals["memory"] += 1
                raise EngineOverloaded(
                    f"{self.scheduler.num_waiting} requests are waiting for the LLM engine (the guard)",
                    retry_after_s=est.wait_s * est.retry_scale,
                    reason="memory",
                )
            try:
                self.scheduler.add(seq, kv_import)
            except QueueFull as e:
                self._refusals["memory"] += 1
                raise EngineOverloaded(
                    str(e), retry_after_s=est.wait_s * est.retry_scale, reason="memory"
                ) from e
            except SchedulerError as e:
                raise EngineRequestError(str(e), "prompt") from e
            self._requests[rid] = req
            if held_any:  # an idle engine's start says nothing of the estimate's error
                self.admission.admitted(rid, est, time.perf_counter())
            self._prompt_tokens_total += seq.num_prompt_tokens
        self._wake.set()
        return RequestStream(rid, req.queue, self.abort)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        mm: Sequence[MultimodalInput] = (),
        request_id: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """``submit`` as an async generator; leaving the loop early aborts the request."""
        stream = self.submit(prompt_ids, sampling, mm, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe; unknown or finished ids are ignored)."""
        self._aborts.append(request_id)
        self._wake.set()

    def _build_request(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        mm: Sequence[MultimodalInput],
        deadline_s: float | None,
        kv_export: bool,
    ) -> Request:
        """The request record, checked against the model (``EngineRequestError`` when it does not fit)."""
        if not prompt_ids:
            raise EngineRequestError("the prompt is empty", "prompt")
        if len(prompt_ids) + sampling.max_tokens > self.max_model_len:
            raise EngineRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}",
                "max_tokens",
            )
        pads = self.tokenizer.media_pad_ids
        for i, item in enumerate(mm):
            if item.ref.modality not in pads:
                raise EngineRequestError(
                    f"this model's tokenizer has no placeholder for {item.ref.modality!r} media",
                    f"multimodal[{i}]",
                )
        try:
            # Each item's rows go to the runs of its own pad, in item order: a video with sound has
            # its frames' runs and its track's runs interleaved (MiMo-V2.5's ``video_audio``).
            spans = media_spans(
                prompt_ids,
                pads.values(),
                [MediaRows(m.ref.key, int(m.embedding.shape[0]), pads[m.ref.modality]) for m in mm],
            )
        except MediaSpanError as e:
            raise EngineRequestError(
                str(e), "multimodal" if e.item is None else f"multimodal[{e.item}]"
            ) from e
        if self._one_run_per_item:
            runs = collections.Counter(span.item for span in spans)
            for i, item in enumerate(mm):
                if item.ref.modality == "audio" or runs[i] > 1:
                    why = "no audio" if item.ref.modality == "audio" else f"{runs[i]} runs for media {i}"
                    raise EngineRequestError(
                        f"this model's M-RoPE positions take one placeholder run per image or video ({why})",
                        f"multimodal[{i}]",
                    )
        hidden = self.model_config.hidden_size
        for i, item in enumerate(mm):
            width = item.embedding.shape[1]
            if width != hidden:
                raise EngineRequestError(
                    f"embedding hidden size {width} != model hidden size {hidden}", f"multimodal[{i}]"
                )
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        return Request.create(
            rid,
            prompt_ids,
            sampling,
            max_new_tokens=sampling.max_tokens,
            stop_token_ids=stop_ids,
            media=spans,
            mm_items=mm,
            deadline_s=deadline_s,
            kv_export=kv_export,
        )

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        idle = True
        while not self._stop.is_set():
            if idle and self.scheduler.has_work():
                self._gather_burst()
            self._wake.clear()  # a submit or abort after this point makes the wait below return
            try:
                busy = self._step()
            except Exception:
                # The scheduler's state can no longer be trusted for the requests it holds: end
                # them all with an error rather than leave their clients waiting forever.
                log.exception("engine step failed outside the forward; failing every request")
                with self._lock:
                    self._fail([r.seq for r in self._requests.values()])
                busy = True
            idle = not busy
            if not busy:
                self._busy_since = None  # the wait below is idle time, not the rate's
                self._wake.wait(0.05)  # idle, or nothing fits in KV until a sequence finishes
        with self._lock:
            for rid in list(self._requests):
                self.scheduler.abort(rid)
                self._finish(self._requests[rid], "abort", [])

    def _gather_burst(self) -> None:
        """Before an idle engine's first step: wait while requests keep arriving, for at most
        ``burst_gather_ms`` (``EngineConfig``), so that a burst shares its first steps. A lone
        request waits ``burst_quiet_ms``; once a second one came (a burst), the gather ends after
        ``BURST_QUIET_FACTOR`` times that without an arrival, or as soon as the waiting prompts
        fill a step (``max_num_batched_tokens``). Every submit sets ``_wake``."""
        cfg = self.config
        if cfg.burst_gather_ms <= 0 or cfg.burst_quiet_ms <= 0:
            return
        end = time.perf_counter() + cfg.burst_gather_ms / 1e3
        quiet = cfg.burst_quiet_ms / 1e3
        step_tokens = self.scheduler.config.max_num_batched_tokens
        while not self._stop.is_set() and (left := end - time.perf_counter()) > 0:
            with self._lock:
                if sum(s.num_tokens - s.num_computed_tokens for s in self.scheduler.waiting) >= step_tokens:
                    return  # the first step is full: waiting longer only delays it
            self._wake.clear()
            if not self._wake.wait(min(quiet, left)):
                return  # quiet: the burst, if any, is in
            quiet = BURST_QUIET_FACTOR * cfg.burst_quiet_ms / 1e3

    def _step(self) -> bool:
        """Schedule, run and publish one step; False when there was nothing to run."""
        t_step = time.perf_counter()
        with self._lock:
            self._drain_aborts()
            batch = self.scheduler.schedule() if self.scheduler.has_work() else None
            if batch is None:
                self._flush_kv_events()
        if batch is None:
            return False
        t0 = time.perf_counter()
        try:
            sampled = self.runner.execute(batch)
        except Exception:
            log.exception("forward failed; failing the requests of the batch")
            with self._lock:
                self._fail(batch.seqs)
            return True
        self.scheduler.copy_out(batch)  # KV leaving the engine (a P/D export), pages still held
        host = self.scheduler.kv.host_tier
        sources = self.scheduler.kv.transfers
        if host is not None or self.scheduler.step_cost is not None:
            # the cost models' prefill rate: prompt tokens computed by multi-token chunks (a copied
            # chunk costs little; a verify chunk, drafts past the known tokens, costs a decode step)
            chunks = [
                n
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                if n > 1 and sources.source(s.seq_id) is None and s.num_computed_tokens + n <= s.num_tokens
            ]
            elapsed = time.perf_counter() - t0
            if host is not None:
                host.cost.observe_prefill(sum(chunks), elapsed)
            if self.scheduler.step_cost is not None:
                self.scheduler.step_cost.observe(len(batch.seqs) - len(chunks), sum(chunks), elapsed)
        # Admission's unit of work: prompt tokens this step computed, and tokens it sampled.
        prompt_done = sum(
            max(min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens, 0)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        with self._lock:
            finished = self.scheduler.update(batch, sampled)
            self._steps += 1
            outs = self._publish(batch.seqs, sampled, finished)
            self._flush_kv_events()
            sampled_n = sum(len(t) if isinstance(t, list) else int(t is not None) for t in sampled)
            # From the end of the last busy step, not this step's start: what happens between
            # steps (handing outputs to the event loop, the GIL it holds) is part of the pace.
            now = time.perf_counter()
            begin = t_step if self._busy_since is None else self._busy_since
            self.admission.observe_step(prompt_done + sampled_n, now - begin)
            self._busy_since = now
        deliver_outputs(outs)
        return True

    @property
    def handoff(self) -> KVHandoff | None:
        """The P/D connector (set by the server): the scheduler consults it with the KV manager's."""
        return self._handoff

    @handoff.setter
    def handoff(self, handoff: KVHandoff | None) -> None:
        self._handoff = handoff
        self.scheduler.connectors = [handoff] if handoff is not None else []

    def pop_export(self, request_id: str) -> KVTransferReport | None:
        """The KV export of a finished ``kv_export`` request (None if it produced none)."""
        return self._handoff.pop_export(request_id) if self._handoff is not None else None

    def _flush_kv_events(self) -> None:
        """Publish what the prefix cache changed this step (caller holds the lock)."""
        radix = self.scheduler.kv.radix
        if self.kv_events is None or radix is None:
            return
        events = radix.drain_events()
        if events:
            self.kv_events.publish(KVEventBatch(time.time(), tuple(events)))

    def _drain_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.popleft()
            req = self._requests.get(rid)
            if req is not None:
                self.scheduler.abort(rid)
                self._finish(req, "abort", [])

    def _publish(
        self, seqs: list[Seq], sampled: list[Sampled], finished: list[Seq]
    ) -> list[tuple[RequestState, StepOutput]]:
        """Turn the step's sampled tokens (several for a verify step) into StepOutputs; finish
        sequences a stop string ended (the tokens after it are dropped)."""
        done_ids = {id(s) for s in finished}
        outs: list[tuple[RequestState, StepOutput]] = []
        n_tokens = 0
        for s, tok in zip(seqs, sampled, strict=True):
            req = self._requests.get(str(s.seq_id))
            if req is None or req.done or tok is None:
                continue
            toks = tok if isinstance(tok, list) else [tok]
            if len(s.output_ids) == len(toks):  # its first tokens (update appended them)
                self.admission.first_token(str(s.seq_id), time.perf_counter())
            done = id(s) in done_ids
            emitted: list[int] = []
            stopped = False
            for i, t in enumerate(toks):
                emitted.append(t)
                if req.add_token(t, render=t not in s.stop_token_ids, last=done and i == len(toks) - 1):
                    stopped = True
                    break
            n_tokens += len(emitted)
            if stopped:
                if not done:
                    self.scheduler.finish(s.seq_id, "stop")
                outs.append((req, self._finish(req, "stop", emitted, deliver=False)))
            elif done:
                outs.append((req, self._finish(req, s.finish_reason or "stop", emitted, deliver=False)))
            else:
                outs.append((req, req.output(emitted, finished=False, reason=None)))
        self._meter.add(n_tokens)
        return outs

    def _finish(self, req: RequestState, reason: str, ids: list[int], deliver: bool = True) -> StepOutput:
        rid = str(req.seq.seq_id)
        self._requests.pop(rid, None)
        self.admission.ended(rid)
        if reason in ("stop", "length"):
            self.admission.observe_finished(req.seq)
        self.runner.release(req.seq.seq_id)
        self._cached_tokens_total += req.seq.num_cached_tokens
        out = req.output(ids, finished=True, reason=reason)
        if deliver:
            deliver_outputs([(req, out)])
        return out

    def _fail(self, seqs: list[Seq]) -> None:
        for s in seqs:
            req = self._requests.get(str(s.seq_id))
            if req is not None:
                with contextlib.suppress(Exception):  # best effort: the state may be inconsistent
                    self.scheduler.abort(s.seq_id)
                self._finish(req, "error", [])

    # ---- observability -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot for /health and /metrics. Counters are read without the lock (values may be
        one step old); the admission rate's running sums are not atomic, so it is read under it."""
        usage = [g.pool.num_used / max(1, g.pool.num_pages) for g in self.scheduler.kv.groups]
        blocks = self.kv.blocks
        pool_usage = blocks.num_used / max(1, blocks.num_pages) if blocks is not None else max(usage)
        with self._lock:
            admission_per_s = self.admission.rate.per_s()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_full_usage=usage[0],
            # the fullest window group; a model without one keeps every page like its full group
            kv_window_usage=max(usage[1:], default=usage[0]),
            kv_pool_usage=pool_usage,
            generation_tokens_total=self._meter.total,
            prompt_tokens_total=self._prompt_tokens_total,
            cached_prompt_tokens_total=self._cached_tokens_total,
            tokens_per_s=self._meter.rate(),
            steps_total=self._steps,
            max_waiting=self.config.max_waiting,
            expected_wait_s=self._expected_wait_s,
            admission_tokens_per_s=admission_per_s,
            refusals=dict(self._refusals),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        spec = self.runner.speculator
        if spec is None:
            return {}
        c = spec.counters()
        return {
            "spec_draft_tokens_total": c.proposed,
            "spec_accepted_tokens_total": c.accepted,
            "spec_acceptance_length": c.acceptance_length,
        }

    def kv_tier_stats(self) -> dict[str, dict[str, object]]:
        """The tiers below the prefix cache (/health, /metrics, ``epd cache``): "host" and "store"
        where configured; counters of this engine, the store's entries and bytes as it reports them."""
        host = self.scheduler.kv.host_tier
        if host is None:
            return {}
        out: dict[str, dict[str, object]] = {"host": host.stats()._asdict()}
        if host.store is not None:
            st = host.store.store.stats()
            out["store"] = {
                "kind": st.kind,
                "location": st.location,
                "policy": host.store_policy,
                **host.store.counters()._asdict(),
            }
        return out

    def check_integrity(self) -> str:
        """ "ok", or what ``KVManager.check_integrity`` found wrong (every used page has exactly one
        owner, the tree's locks match the sequences holding hits); under the lock, between steps."""
        with self._lock:
            try:
                self.scheduler.kv.check_integrity(self.scheduler.running)
            except AssertionError as e:
                return f"broken: {e}"
        return "ok"

    def load(self) -> EngineLoad:
        """The requests held and their token load (briefly takes the lock: never during a forward)."""
        with self._lock:
            prefill, decode = self.scheduler.token_load()
            return EngineLoad(list(self._requests), prefill, decode)

    @classmethod
    def from_checkpoint(
        cls,
        model_path: str | Path,
        config: EngineConfig | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_events: KVEventPublisher | None = None,
    ) -> LLMEngine:
        """Load a checkpoint directory (the embedded default's: ``llm_core.tools.default_llm``)
        with its tokenizer and build an engine."""
        from llm_core.models.checkpoint import load_llm
        from llm_core.prompts.tokenizer import load_tokenizer

        loaded = load_llm(model_path, dtype=dtype, device=device)
        tokenizer = load_tokenizer(loaded.model_dir)
        engine = cls(
            loaded.model,
            loaded.config,
            tokenizer,
            config,
            device,
            dtype,
            loaded.positions,
            kv_events,
            loaded.mtp,
        )
        engine.model_dir = loaded.model_dir
        return engine

    def attach_kv_store(self, store: Store, ttl_s: float | None = None) -> KVStoreTier | None:
        """Put the shared store under the host tier (``EngineConfig.kv_store_policy``): evicted
        pages go there and come back from there, also to other engines of the same weights. None
        (and nothing attached) without a host tier or with the policy "off"."""
        host = self.scheduler.kv.host_tier
        if host is None or self.config.kv_store_policy == "off":
            return None
        layout, page = self.kv.layout, self.kv.page_size
        tier = KVStoreTier(
            store,
            model_kv_id(self.model_dir, layout, self.dtype, page),
            layout,
            page,
            self.dtype,
            ttl_s=ttl_s,
        )
        tier.on_ready = self._wake.set  # a waiting sequence's pages arrived: schedule again
        host.store, host.store_policy = tier, self.config.kv_store_policy
        self.scheduler.kv.connect_tiers()  # the store's connector joins the host tier's
        return tier


def _build_kv_and_scheduler(
    cfg: DecoderConfig,
    ec: EngineConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    record_events: bool = False,
    mtp_layers: int = 0,
) -> tuple[PagedKVCache, Scheduler]:
    """The KV storage sized from the byte budget (one shared block pool; a pool per group with
    ``window_fraction``), the KV manager over it and the scheduler.
    ``mtp_layers``: window layers for the MTP heads' KV beside the model's (speculative decoding)."""
    layout = KVLayout.from_model_config(cfg, dtype, mtp_layers=mtp_layers)
    kv_cfg = KVCacheConfig(
        memory_budget_bytes=ec.kv_memory_bytes,
        page_size=ec.page_size,
        window_fraction=ec.window_fraction,
        # A pool per group only (groups that do not pack into blocks): split so that both pools
        # run out together for sequences as long as the model allows.
        balance_context_len=min(max_model_len, 8192),
        # Room for one prefill chunk beyond the windows in the window groups' pools.
        window_headroom_tokens=min(ec.max_num_batched_tokens, max_model_len),
    )
    kv = PagedKVCache.from_budget(layout, kv_cfg, dtype, device)
    host = HostKVTier(kv, ec.host_kv_bytes) if ec.host_kv_bytes > 0 else None
    manager = KVManager(
        group_managers(kv),
        enable_prefix_cache=ec.enable_prefix_cache,
        record_events=record_events,
        host_tier=host,
    )
    # The MTP heads' queries trail the target's by up to k + 1 positions: keep their window too.
    manager.window_extra_tokens = mtp_layers + 1 if mtp_layers else 0
    manager.mtp_backoff = mtp_layers > 0
    sched_cfg = SchedulerConfig(
        max_num_seqs=ec.max_num_seqs,
        max_num_batched_tokens=ec.max_num_batched_tokens,
        max_prefill_chunk=ec.max_prefill_chunk,
        max_model_len=max_model_len,
        max_waiting=ec.max_waiting,
        kv_copy_overlap=ec.kv_copy_overlap,
    )
    scheduler = Scheduler(sched_cfg, manager)
    if ec.prefill_stall_factor > 0:
        scheduler.step_cost = StepCost(ec.prefill_stall_factor, ec.prefill_step_floor_ms / 1e3)
    return kv, scheduler
