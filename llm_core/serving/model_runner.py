"""Model runner: one scheduled batch in, one sampled token per finished-prefill sequence out.

    SchedulerOutput(seqs, num_new_tokens, page_rows, copies)
        -> KV copies (before or beside the forward)
        -> input_ids [T], positions [T] (or [3, T]: the model's PositionScheme), AttentionBatch,
           input_embeds [T, hidden] (media only)
        -> model.forward -> hidden [T, hidden]
        -> hidden at each sampling sequence's last new token [S, hidden] -> logits [S, vocab]
        -> Sampler -> token id, or None for sequences whose prefill chunk did not reach the end

The runner reads sequences and never changes their progress (the scheduler does that in
``update``). It samples through ``SequenceSampling`` (each seeded request keeps one random stream
across steps, chunks and preemptions). With speculation it packs each sequence's drafts after its
last known token and hands the forward's rows to the speculator in one call
(``Speculator.verify_and_propose``). It knows nothing of HTTP, tokenization or queues.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from llm_core.backends.selector import Backends
from llm_core.caches.kv_pool import PagedKVCache
from llm_core.kernels.attention_batch import AttentionBatch
from llm_core.models.positions import LinearPositions, PositionScheme
from llm_core.request import Sampled, Sequence
from llm_core.serving.kv_copy import CopyPlan, LayeredCopy, copy_sequentially
from llm_core.serving.page_tables import DecodePageTables, TokenPositions, build_page_tables, token_positions
from llm_core.serving.sampling import Sampler
from llm_core.serving.scheduler_output import SchedulerOutput
from llm_core.serving.sequence_sampling import SequenceSampling
from llm_core.serving.speculative import Speculator, TargetRows

# Logits projections of at most this many multiply-adds (rows x hidden x vocab; 2M for 32 rows of
# the tiny Qwen2.5-VL) run on one torch thread (``ModelRunner._logits``): ~0.1 ms on one core.
SMALL_LOGITS_MACS = 1 << 23


class CausalLM(Protocol):
    """What the runner needs from the model (``llm_core.models.decoder.DecoderForCausalLM``)."""

    backends: Backends  # what runs its kernels, chosen once (``after_load``)

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batch: AttentionBatch,
        kv: PagedKVCache,
        input_embeds: Tensor | None = None,
    ) -> Tensor: ...

    def embed(self, input_ids: Tensor) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...


class StepInputs(NamedTuple):
    """Everything one forward needs, on the model's device."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T], or [3, T] with M-RoPE (``positions.MRopePositions``)
    batch: AttentionBatch
    input_embeds: Tensor | None  # [T, hidden] when any new token is a media placeholder
    sample_rows: Tensor  # int64 [S] packed row of each sampling sequence's last new token
    sample_seqs: list[int]  # [S] index into the batch's seqs


class ModelRunner:
    """Turns scheduled batches into forwards and sampled tokens."""

    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        sampler: Sampler,
        device: torch.device | str = "cpu",
        positions: PositionScheme | None = None,
        vocab_size: int | None = None,
        kv_copy_overlap: bool = True,
    ) -> None:
        """``vocab_size``: the logits' width, which sizes the logits projection (``_logits``); None:
        always with torch's thread count. ``kv_copy_overlap``: copy a step's KV copies beside its
        forward, layer by layer (``kv_copy.LayeredCopy``), instead of before it."""
        self.model = model
        self.vocab_size = vocab_size
        self.position_scheme: PositionScheme = positions or LinearPositions()
        self.kv = kv
        self.page_size = kv.page_size
        self.device = torch.device(device)
        self.sampling = SequenceSampling(sampler, self.device)
        self._cpu = self.device.type == "cpu"
        self._aranges: dict[tuple[int, torch.dtype], Tensor] = {}
        self._decode_tables = DecodePageTables()  # kept across decode steps (rows patched)
        self.kv_copy_overlap = kv_copy_overlap
        # Speculative decoding with the MTP heads (set by the engine; None: one token per step).
        self.speculator: Speculator | None = None
        # Chunks that copied KV and computed in the same step (a restore crossing its end).
        self.num_overlapped_copies = 0

    def prepare(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], rows: list[list[list[int]]]
    ) -> StepInputs:
        """Pack the new tokens of ``seqs``; ``num_new_tokens[b]`` start at ``num_computed_tokens``;
        ``rows[b]``: the page rows per KV group of ``seqs[b]`` (``SchedulerOutput.page_rows``)."""
        assert len(seqs) == len(num_new_tokens) == len(rows) and seqs
        if max(num_new_tokens) == 1:
            decode = self._prepare_decode(seqs, rows)
            if decode is not None:
                return decode
        return self._prepare_packed(seqs, num_new_tokens, rows)

    def _prepare_decode(self, seqs: Seq[Sequence], page_rows: list[list[list[int]]]) -> StepInputs | None:
        """``prepare`` for a decode step: every sequence computes one token, its last (so every one
        samples), at positions its scheme gives by offsets, and no token is a media placeholder.
        One pass over the sequences for their ids, positions and page rows, then array operations
        (``DecodePageTables``); None when a sequence does not qualify (a one-token prefill
        chunk, a prompt-end token inside a media prompt): then ``_prepare_packed``."""
        scheme = self.position_scheme
        linear = scheme.dims == 1
        ids: list[int] = []
        starts: list[int] = []
        offsets: list[tuple[int, ...]] = []
        for s in seqs:
            start = s.num_computed_tokens
            prompt, out = s.prompt_ids, s.output_ids
            n_prompt = len(prompt)
            if start != n_prompt + len(out) - 1 or (start < n_prompt and s.media):
                return None
            if not linear:
                o = scheme.linear_offsets(s, start)
                if o is None:
                    return None
                offsets.append(o)
            ids.append(out[-1] if out else prompt[-1])
            starts.append(start)
        b = len(seqs)
        start_np = np.array(starts, dtype=np.int64)  # [B] position of each new token
        tables = self._decode_tables.build(list(seqs), page_rows, start_np, self.page_size)
        page_tables, slots = self.kv.page_map.view_tables(*tables, self.page_size)  # per layer view
        if linear:
            pos_np = start_np
        else:  # [dims, B]: the token's index plus its axis' offset
            pos_np = np.ascontiguousarray(np.array(offsets, dtype=np.int64).T + start_np)
        on = self._on_device
        batch = AttentionBatch(
            cu_seqlens_q=self._arange(b + 1, torch.int32),
            seq_lens=on(torch.from_numpy((start_np + 1).astype(np.int32))),
            page_tables=tuple(on(t) for t in page_tables),
            slots=tuple(on(t) for t in slots),
            max_seqlen_q=1,
        )
        return StepInputs(
            input_ids=on(torch.from_numpy(np.array(ids, dtype=np.int64))),
            positions=on(torch.from_numpy(pos_np)),
            batch=batch,
            input_embeds=None,
            sample_rows=self._arange(b),
            sample_seqs=list(range(b)),
        )

    def _on_device(self, t: Tensor) -> Tensor:
        """``t`` (on the CPU) moved to the model's device; itself on a CPU model, without a ``.to``
        call, which releases the GIL (a chance for the event loop thread to take it mid-step)."""
        return t if self._cpu else t.to(self.device)

    def _arange(self, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
        """``torch.arange(n)`` on the device, made once per (n, dtype): steps only read it."""
        key = (n, dtype)
        t = self._aranges.get(key)
        if t is None:
            with torch.inference_mode(False):  # usable inside and outside inference mode
                t = self._aranges[key] = torch.arange(n, dtype=dtype, device=self.device)
        return t

    def _prepare_packed(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], page_rows: list[list[list[int]]]
    ) -> StepInputs:
        """``prepare`` for any step (prefill chunks, decodes, media): the ids of each sequence in one
        Python list, positions and write slots by array operations over the packed tokens."""
        ids: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        has_media = False
        for b, (s, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            known = s.num_tokens
            if end <= known:
                assert n > 0, (s.seq_id, start, n, known)
                ids.extend(s.token_slice(start, end))
            else:  # a verify chunk: the last known token, then drafts (``speculative.py``)
                drafts = self._drafts(s)
                assert n > 0 and end <= known + len(drafts), (s.seq_id, start, n, known)
                ids.extend(s.token_slice(start, known) + drafts[: end - known])
            if end >= known:  # the chunk reaches the last known token: its logits (and the drafts') are next
                first = len(ids) - (end - known) - 1
                sample_rows.extend(range(first, len(ids)))
                sample_seqs.extend([b] * (end - known + 1))
            has_media = has_media or any(m.start < end and m.start + m.length > start for m in s.media)
        seq_list, counts = list(seqs), list(num_new_tokens)
        tokens = token_positions(seq_list, counts)
        tables = build_page_tables(seq_list, page_rows, counts, self.page_size, tokens)
        page_tables, slots = self.kv.page_map.view_tables(*tables, self.page_size)  # per layer view
        on = self._on_device
        count_np = np.array(counts, dtype=np.int32)
        cu_seqlens = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(count_np, out=cu_seqlens[1:])
        seq_lens = count_np + np.array([s.num_computed_tokens for s in seqs], dtype=np.int32)
        batch = AttentionBatch(
            cu_seqlens_q=on(torch.from_numpy(cu_seqlens)),
            seq_lens=on(torch.from_numpy(seq_lens)),
            page_tables=tuple(on(t) for t in page_tables),
            slots=tuple(on(t) for t in slots),
            max_seqlen_q=max(num_new_tokens),
        )
        input_ids = on(torch.from_numpy(np.array(ids, dtype=np.int64)))  # ~4x torch.tensor's speed
        embeds = self._media_embeds(seqs, num_new_tokens, input_ids) if has_media else None
        return StepInputs(
            input_ids=input_ids,
            positions=on(torch.from_numpy(self._packed_positions(seqs, counts, tokens))),
            batch=batch,
            input_embeds=embeds,
            sample_rows=on(torch.from_numpy(np.array(sample_rows, dtype=np.int64))),
            sample_seqs=sample_seqs,
        )

    def _packed_positions(self, seqs: Seq[Sequence], counts: list[int], tokens: TokenPositions) -> np.ndarray:
        """int64 [T] positions (token i at position i), or [dims, T] of a multi-axis scheme: the
        token's index plus its sequence's offset per axis where every sequence has offsets
        (``linear_offsets``), else ``_positions_nd``."""
        scheme = self.position_scheme
        if scheme.dims == 1:
            return tokens.position
        offsets = [scheme.linear_offsets(s, s.num_computed_tokens) for s in seqs]
        if any(o is None for o in offsets):
            return np.array(self._positions_nd(seqs, counts), dtype=np.int64)
        per_token = np.array(offsets, dtype=np.int64)[tokens.seq].T  # [dims, T]
        return np.ascontiguousarray(per_token + tokens.position)

    def _positions_nd(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]) -> list[list[int]]:
        """[dims][T] positions of a multi-axis scheme (M-RoPE) as Python rows: offsets per axis where
        the scheme has them (decode steps, text-only prompts), its position tensor elsewhere."""
        scheme = self.position_scheme
        rows: list[list[int]] = [[] for _ in range(scheme.dims)]
        for s, n in zip(seqs, num_new_tokens, strict=True):
            start = s.num_computed_tokens
            offsets = scheme.linear_offsets(s, start)
            if offsets is None:
                for row, part in zip(rows, scheme.positions(s, start, start + n).tolist(), strict=True):
                    row.extend(part)
            else:
                for row, o in zip(rows, offsets, strict=True):
                    row.extend(range(start + o, start + n + o))
        return rows

    def _media_embeds(self, seqs: Seq[Sequence], num_new_tokens: Seq[int], input_ids: Tensor) -> Tensor:
        """Token embeddings with media rows written over the placeholder positions.

        A span may be cut by chunked prefill; only its part inside this chunk is copied::

            sequence positions   [start ................ end)        this step's chunk
            media span               [m.start ............... m.start + m.length)
            copied                   [lo ............ hi)            rows lo - m.start .. hi - m.start
        """
        embeds = self.model.embed(input_ids)  # [T, hidden]
        row0 = 0
        for s, n in zip(seqs, num_new_tokens, strict=True):
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            for m in s.media:
                lo, hi = max(start, m.start), min(end, m.start + m.length)
                if lo >= hi:
                    continue
                # [hi - lo, hidden]: the item's rows this run holds, from its ``row``
                rows = s.mm_items[m.item].embedding[m.row + lo - m.start : m.row + hi - m.start]
                embeds[row0 + lo - start : row0 + hi - start] = rows.to(embeds.device, embeds.dtype)
            row0 += n
        return embeds

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[Sampled]:
        """Run one step; the sampled token of each sequence, None where prefill is not complete,
        a list for a sequence that verified drafts (the tokens it accepted, ``speculative.py``).

        A sequence whose chunk lies in its ``kv_source`` (``caches/kv_source.py``) has it copied
        instead of computed (``step.copies``; the part past the source's end, if any, computed); a
        source that covers the whole prompt yields the token after it."""
        if step.copies is not None:
            return self._execute_with_copies(step, step.copies)
        return self._forward(step.seqs, step.num_new_tokens, step.page_rows)

    def _forward(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], page_rows: list[list[list[int]]]
    ) -> list[Sampled]:
        """``execute`` of chunks that all compute (no copies)."""
        inp = self.prepare(seqs, num_new_tokens, page_rows)
        hidden = self.model(inp.input_ids, inp.positions, inp.batch, self.kv, inp.input_embeds)  # [T, hidden]
        logits, tokens = hidden[:0], []
        if inp.sample_seqs:
            # Every row samples (a decode step): the rows in order, no gather needed.
            every_row = len(inp.sample_seqs) == hidden.shape[0]
            rows = hidden if every_row else hidden.index_select(0, inp.sample_rows)
            logits = self._logits(rows)  # [S, vocab]
            tokens = self.sampling.sample(logits, seqs, inp.sample_seqs)
        if self.speculator is not None:
            target = TargetRows(hidden, logits, inp.sample_seqs, tokens)
            return self.speculator.verify_and_propose(seqs, num_new_tokens, page_rows, target)
        if len(tokens) == len(seqs):  # every sequence sampled, in order
            return list(tokens)
        out: list[Sampled] = [None] * len(seqs)
        for b, t in zip(inp.sample_seqs, tokens, strict=True):
            out[b] = t
        return out

    def _execute_with_copies(self, step: SchedulerOutput, plan: CopyPlan) -> list[Sampled]:
        """``execute`` of a step in which some chunks copy KV (``kv_copy.py``): their copies, then
        or beside (``kv_copy_overlap``) the forward of the rest, a crossing chunk's computed tail
        included."""
        self.num_overlapped_copies += plan.num_crossing
        if not plan.compute_seqs:  # only copies: no forward to hide them behind
            copy_sequentially(self.kv, plan.jobs)
            return list(plan.out)
        rows = [step.page_rows[b] for b in plan.compute_index]
        if self.kv_copy_overlap:
            with LayeredCopy(self.kv, plan.jobs):
                sampled = self._forward(plan.compute_seqs, plan.compute_tokens, rows)
        else:
            copy_sequentially(self.kv, plan.jobs)
            sampled = self._forward(plan.compute_seqs, plan.compute_tokens, rows)
        out = list(plan.out)
        for b, t in zip(plan.compute_index, sampled, strict=True):
            out[b] = t
        return out

    def _logits(self, rows: Tensor) -> Tensor:
        """``model.compute_logits(rows)`` [S, hidden] -> [S, vocab]; on one torch thread when the
        product is small (``SMALL_LOGITS_MACS``). Why: right after the decoder layers the layer
        kernel's worker threads still spin on the other cores (``cpu_layer``), so a matmul split
        over torch's threads waits for a core (~0.1-0.2 ms a step on 2 cores, several ms on a loaded
        machine) for work one thread does in tens of microseconds. The product is the same either
        way: BLAS splits the rows and columns of the output between threads, never the sum."""
        threads = torch.get_num_threads()
        small = (
            self.vocab_size is not None
            and rows.device.type == "cpu"
            and rows.shape[0] * rows.shape[-1] * self.vocab_size <= SMALL_LOGITS_MACS
        )
        if threads == 1 or not small:
            return self.model.compute_logits(rows)
        torch.set_num_threads(1)
        try:
            return self.model.compute_logits(rows)
        finally:
            torch.set_num_threads(threads)

    def _drafts(self, s: Sequence) -> list[int]:
        """``s``'s drafts (the speculator's, by request id; none without speculation)."""
        return self.speculator.states.drafts(s.seq_id) if self.speculator is not None else []

    def release(self, seq_id: int | str) -> None:
        """Forget a finished or aborted sequence's generator, positions and drafts."""
        self.sampling.release(seq_id)
        self.position_scheme.release(seq_id)
        if self.speculator is not None:
            self.speculator.states.release(seq_id)
