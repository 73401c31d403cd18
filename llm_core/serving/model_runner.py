"""Model runner: one scheduled batch in, one sampled token per finished-prefill sequence out.

    ScheduledBatch(seqs, num_new_tokens)
        -> input_ids [T], positions [T] (or [3, T]: the model's PositionScheme), AttentionBatch,
           input_embeds [T, hidden] (media only)
        -> model.forward -> hidden [T, hidden]
        -> hidden at each sampling sequence's last new token [S, hidden] -> logits [S, vocab]
        -> Sampler -> token id, or None for sequences whose prefill chunk did not reach the end

The runner reads sequences and never changes their progress (the scheduler does that in
``update``). It owns the per-request sampling generators, keyed by ``seq_id``, so that a seeded
request keeps one random stream across steps, chunks and preemptions. It knows nothing of HTTP,
tokenization or queues.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from encoder.caches.embedding_ref import EmbeddingRef
from llm_core.caches.kv_pool import DualKVCache
from llm_core.kernels.attention_batch import AttentionBatch
from llm_core.models.positions import LinearPositions, PositionScheme
from llm_core.serving.sampling import Sampler, SamplingParams
from llm_core.serving.sequence import Sequence, build_page_tables


class MultimodalInput(NamedTuple):
    """One media item of a request: its reference and embedding rows [num_tokens, hidden].

    The tensor may be a zero-copy view of the node embedding cache; the runner only reads it.
    """

    ref: EmbeddingRef
    embedding: Tensor  # [num_tokens, hidden]


class CausalLM(Protocol):
    """What the runner needs from the model (``llm_core.models.decoder.DecoderForCausalLM``)."""

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batch: AttentionBatch,
        kv: DualKVCache,
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
        kv: DualKVCache,
        sampler: Sampler,
        device: torch.device | str = "cpu",
        positions: PositionScheme | None = None,
    ) -> None:
        self.model = model
        self.position_scheme: PositionScheme = positions or LinearPositions()
        self.kv = kv
        self.page_size = kv.page_size
        self.sampler = sampler
        self.device = torch.device(device)
        self._generators: dict[int | str, torch.Generator | None] = {}

    def prepare(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]) -> StepInputs:
        """Pack the new tokens of ``seqs``; ``num_new_tokens[b]`` start at ``num_computed_tokens``."""
        assert len(seqs) == len(num_new_tokens) and seqs
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        seq_lens: list[int] = []
        cu_seqlens = [0]
        linear = self.position_scheme.dims == 1
        has_media = False
        for b, (s, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            assert n > 0 and end <= s.num_tokens, (s.seq_id, start, n, s.num_tokens)
            ids.extend(s.token_slice(start, end))
            if linear:
                pos.extend(range(start, end))
            seq_lens.append(end)
            cu_seqlens.append(cu_seqlens[-1] + n)
            if end == s.num_tokens:  # the chunk reaches the last known token: its logits are next
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(b)
            has_media = has_media or any(m.start < end and m.start + m.length > start for m in s.media)
        tables = build_page_tables(list(seqs), list(num_new_tokens), self.page_size)
        dev = self.device
        batch = AttentionBatch(
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            full_page_table=tables.full_page_table.to(dev),
            swa_page_table=tables.swa_page_table.to(dev),
            full_slots=tables.full_slots.to(dev),
            swa_slots=tables.swa_slots.to(dev),
            max_seqlen_q=max(num_new_tokens),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        embeds = self._media_embeds(seqs, num_new_tokens, input_ids) if has_media else None
        if linear:  # token i at position i (the common case, kept cheap)
            positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        else:
            positions = torch.tensor(self._positions_nd(seqs, num_new_tokens), dtype=torch.int64, device=dev)
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            batch=batch,
            input_embeds=embeds,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sample_seqs=sample_seqs,
        )

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
            for m, item in zip(s.media, s.mm_items, strict=True):
                lo, hi = max(start, m.start), min(end, m.start + m.length)
                if lo >= hi:
                    continue
                rows = item.embedding[lo - m.start : hi - m.start]  # [hi - lo, hidden]
                embeds[row0 + lo - start : row0 + hi - start] = rows.to(embeds.device, embeds.dtype)
            row0 += n
        return embeds

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]) -> list[int | None]:
        """Run one step; the sampled token of each sequence, None where prefill is not complete."""
        inp = self.prepare(seqs, num_new_tokens)
        hidden = self.model(inp.input_ids, inp.positions, inp.batch, self.kv, inp.input_embeds)  # [T, hidden]
        out: list[int | None] = [None] * len(seqs)
        if not inp.sample_seqs:
            return out
        logits = self.model.compute_logits(hidden.index_select(0, inp.sample_rows))  # [S, vocab]
        params: list[SamplingParams] = []
        gens: list[torch.Generator | None] = []
        for b in inp.sample_seqs:
            s = seqs[b]
            p = s.sampling if isinstance(s.sampling, SamplingParams) else SamplingParams(temperature=0.0)
            params.append(p)
            if s.seq_id not in self._generators:
                self._generators[s.seq_id] = p.make_generator(logits.device)
            gens.append(self._generators[s.seq_id])
        tokens = self.sampler(logits, params, gens).tolist()
        for b, t in zip(inp.sample_seqs, tokens, strict=True):
            out[b] = int(t)
        return out

    def release(self, seq_id: int | str) -> None:
        """Forget a finished or aborted sequence's generator and positions."""
        self._generators.pop(seq_id, None)
        self.position_scheme.release(seq_id)
