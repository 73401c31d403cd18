"""Speculative decoding with the model's multi-token-prediction (MTP) heads: after each step, the
heads extend their KV over the positions whose tokens are known and propose the next k tokens;
the next step verifies them in one target forward over k + 1 positions per sequence.

One step of a decoding sequence with n known tokens and drafts d_1..d_k::

    target   positions n-1 .. n+k-1, tokens [t_{n-1}, d_1 .. d_k]  ->  greedy g_0 .. g_k
    accept   a = leading i with d_{i+1} == g_i;  new tokens d_1..d_a, g_a   (a + 1 of them)
    MTP      layer j at position i reads token t_{i+j+1} and h^j_i (h^0: the target's hidden), for
             i from ``mtp_start`` to the last position with a new hidden state; at that last
             position the tokens past the known ones are the drafts just made, so layer j there
             proposes d'_{j+1} (``mtp.MTPHeads.forward_layer``)

The target's output is the same with or without speculation: every emitted token is the target's
own greedy choice at its position (a draft only decides how many of them one forward yields).
Wrong MTP KV (a position computed with a draft that was then rejected) only lowers acceptance;
it is recomputed from ``mtp_start`` = the first position some layer computed from a draft. A
prefix hit is backed off to the previous hit point (``KVManager.match_prefix``), since the
cached MTP KV of a prefix's last positions was computed from tokens past it. Sequences that sample
(temperature > 0) draw their drafts from the heads' filtered distribution and verify them by
rejection sampling (``accept_sampled``): their output is distributed exactly as without drafts.

The runner makes one call a step, ``verify_and_propose``, with what the target's forward gave
(``TargetRows``); drafts are read back from ``states`` (the scheduler cuts them to what a step
verifies, the runner packs them). Sampled requests draw and verify through the runner's
``SequenceSampling``, so one generator per request serves target and drafts alike.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from epd_common.runtime import torch_threads
from llm_core.caches.kv_pool import PagedKVCache
from llm_core.kernels.attention_batch import AttentionBatch
from llm_core.models.decoder import RopeTables
from llm_core.models.mtp import MTPHeads
from llm_core.request import Sampled, Sequence
from llm_core.serving.draft_state import DraftState, DraftStates
from llm_core.serving.page_tables import build_page_tables, token_positions
from llm_core.serving.sampling import filtered_probs, params_of
from llm_core.serving.sequence_sampling import SequenceSampling


class TargetModel(Protocol):
    """What the heads need of the target model (``decoder.DecoderForCausalLM``)."""

    def embed(self, input_ids: Tensor) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> RopeTables: ...


class SpecCounters(NamedTuple):
    proposed: int  # draft tokens verified
    accepted: int  # of those, the ones the target agreed with
    verify_steps: int  # sequence-steps that verified drafts

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a verifying sequence-step yields (accepted drafts + the target's own)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The tokens a verify step yields: ``target`` [k+1] are the target's greedy tokens at the
    positions of [last, d_1 .. d_k]; the drafts up to the first that differs, then the target's."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return [*drafts[:a], target[a]]


def accept_sampled(drafts: list[int], q: Tensor, p: Tensor, gen: torch.Generator) -> list[int]:
    """Rejection sampling (Leviathan et al., 2023): draft x_i was drawn from q_i [V]; it is kept with
    probability min(1, p_i(x_i) / q_i(x_i)) where p_i [V] is the target's distribution at its
    position; the first rejected position draws from max(0, p_i - q_i) renormalized instead, and if
    every draft is kept one more token is drawn from p_k. Each emitted token is then distributed
    exactly as the target's sampler would draw it. ``q`` [k, V], ``p`` [k + 1, V] (the same
    temperature / top-k / top-p filtering, ``sampling.filtered_probs``)."""
    out: list[int] = []
    for i, x in enumerate(drafts):
        u = float(torch.rand((), generator=gen, device=p.device))
        px, qx = float(p[i, x]), float(q[i, x])
        if u * qx < px:  # u < p/q: accepted (q(x) > 0, x was drawn from it)
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        out.append(int(torch.multinomial(dist, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=gen)))
    return out


class _Rows(NamedTuple):
    seq: Sequence
    pages: list[list[int]]  # its page row per KV group
    state: DraftState  # the sequence's drafts and MTP progress
    lo: int  # first MTP position this step
    hi: int  # one past the last
    h0: Tensor  # [hi - lo, hidden]
    tokens: list[int]  # known tokens from position lo + 1, then the drafts of this step as they come
    drafting: bool


class TargetRows(NamedTuple):
    """What one step's target forward gave: every new token's hidden state, and the logits and
    sampled token of each row that samples (a chunk reaching its last known token: that token's
    row, then one per draft it verifies)."""

    hidden: Tensor  # [T, hidden], the step's tokens packed in batch order
    logits: Tensor  # [S, V]
    rows_seq: list[int]  # [S] the batch index of each sampled row
    tokens: list[int]  # [S] the target's token at each row (its sampler's draw)


class Speculator:
    """Verifies last step's drafts and proposes the next ones (``verify_and_propose``), and counts
    acceptance."""

    def __init__(
        self,
        heads: MTPHeads,
        target: TargetModel,
        kv: PagedKVCache,
        num_steps: int,
        sampling: SequenceSampling,
    ) -> None:
        """``sampling``: the runner's, whose per-request generators draw a sampled request's drafts
        and accept or reject them; greedy requests take the argmax."""
        assert 1 <= num_steps <= len(heads.heads()), (num_steps, len(heads.heads()))
        self.sampling = sampling
        self.heads = heads
        self.target = target
        self.kv = kv
        self.k = num_steps
        self.page_size = kv.page_size
        self._proposed = self._accepted = self._verify_steps = 0
        # Per request id: its drafts and MTP progress (the scheduler reads and cuts the drafts).
        self.states = DraftStates()

    def counters(self) -> SpecCounters:
        return SpecCounters(self._proposed, self._accepted, self._verify_steps)

    def _count_verified(self, num_drafts: int, num_new: int) -> None:
        self._proposed += num_drafts
        self._accepted += num_new - 1
        self._verify_steps += 1

    @torch.inference_mode()
    def verify_and_propose(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        page_rows: Seq[list[list[int]]],
        target: TargetRows,
    ) -> list[Sampled]:
        """One step's tokens: a sequence whose chunk verified drafts gets the tokens it accepted (a
        list: the drafts up to the first the target refuses, then the target's own), the others
        the target's token, or None mid-prefill. Then the heads extend their KV over the rows now
        known and propose each sequence's next drafts (``extend``)."""
        by_seq: dict[int, list[int]] = {}
        rows_of: dict[int, list[int]] = {}  # batch index -> its rows in ``target.logits``
        for i, (b, t) in enumerate(zip(target.rows_seq, target.tokens, strict=True)):
            by_seq.setdefault(b, []).append(t)
            rows_of.setdefault(b, []).append(i)
        out: list[Sampled] = [None] * len(seqs)
        new_tokens: list[list[int]] = []
        valid: list[Tensor] = []
        row0 = 0
        for b, (s, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            toks = by_seq.get(b, [])
            drafts = s.num_computed_tokens + n - s.num_tokens  # > 0: this chunk verifies drafts
            if drafts > 0:
                toks = self._accept(s, drafts, toks, target.logits, rows_of[b])
                self._count_verified(drafts, len(toks))
                out[b] = toks
            elif toks:
                out[b] = toks[0]
            new_tokens.append(toks)
            # rows whose tokens are now known: all of a chunk, the accepted part of a verify
            valid.append(target.hidden[row0 : row0 + (len(toks) if drafts > 0 else n)])
            row0 += n
        self.extend(seqs, page_rows, [s.num_computed_tokens for s in seqs], new_tokens, valid)
        return out

    def _accept(
        self, s: Sequence, drafts: int, target: list[int], logits: Tensor, rows: list[int]
    ) -> list[int]:
        """The tokens ``s``'s verify chunk yields: ``target`` [drafts + 1] the target's draws, and
        ``logits[rows]`` [drafts + 1, V] its logits at the positions of [last, d_1 .. d_drafts]
        (gathered for a sampled sequence only: a greedy one compares ids)."""
        p = params_of(s.sampling)
        st = self.states.of(s.seq_id)
        if p.greedy:
            return accept_greedy(st.draft_ids[:drafts], target)
        probs = filtered_probs(logits[rows], [p] * (drafts + 1))  # [drafts + 1, V] the target's distributions
        q = torch.stack(st.draft_probs[:drafts])
        return accept_sampled(st.draft_ids[:drafts], q, probs, self.sampling.generator(s))

    @torch.inference_mode()
    def extend(
        self,
        seqs: Seq[Sequence],
        page_rows: Seq[list[list[int]]],
        starts: Seq[int],
        new_tokens: Seq[list[int]],
        hidden: Seq[Tensor],
    ) -> None:
        """After a step: ``seqs[b]`` (page rows ``page_rows[b]``, the step's: the heads' layers are
        in the window groups) computed positions from ``starts[b]``, of which the first
        ``len(hidden[b])`` rows are valid (their target hidden states), and gained
        ``new_tokens[b]`` (not yet appended to the sequence).
        Extends every MTP layer's KV and sets each sequence's drafts for the next step."""
        rows: list[_Rows] = []
        for s, pages, c, new, h in zip(seqs, page_rows, starts, new_tokens, hidden, strict=True):
            st = self.states.of(s.seq_id)
            num_known = s.num_tokens + len(new)  # tokens after this step
            f = c + h.shape[0] - 1  # the last position with a target hidden state
            prev = st.mtp_h0 if st.mtp_h0 is not None else h[:0]
            lo = max(st.mtp_start, c - prev.shape[0])  # h^0 is known from ``lo`` on
            h0 = torch.cat([prev[prev.shape[0] - (c - lo) :], h]) if c > lo else h[lo - c :]
            drafting = bool(new) and num_known < s.max_new_tokens + s.num_prompt_tokens
            # Without a token sampled this step (a prefill chunk) no draft fills the gap: layer
            # k-1 at position i needs token i + k, so stop where it is known.
            hi = f + 1 if drafting else min(f + 1, num_known - self.k)
            st.draft_ids, st.draft_probs = [], []
            if hi <= lo:
                st.mtp_start, st.mtp_h0 = lo, h0
                continue
            # tokens from position lo + 1 on (the first any layer reads), then this step's drafts
            tokens = s.token_slice(lo + 1, s.num_tokens) + list(new)
            rows.append(_Rows(s, pages, st, lo, hi, h0[: hi - lo], tokens, drafting))
            # What the next step recomputes from: positions some layer computed from a draft.
            nxt = min(hi, num_known - self.k) if drafting else hi
            nxt = max(nxt, lo)
            st.mtp_start, st.mtp_h0 = nxt, h0[nxt - lo :]
        if rows:
            self._run_heads(rows)

    def _run_heads(self, rows: list[_Rows]) -> None:
        seqs = [r.seq for r in rows]
        counts = np.array([r.hi - r.lo for r in rows], dtype=np.int64)  # [B]
        tokens = token_positions(seqs, counts.tolist(), starts=[r.lo for r in rows])  # from each lo
        tables = build_page_tables(seqs, [r.pages for r in rows], counts.tolist(), self.page_size, tokens)
        page_tables, slots = self.kv.page_map.view_tables(*tables, self.page_size)  # per layer view
        dev = self.kv.layer(0).k.device
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(counts, out=cu[1:])
        batch = AttentionBatch(
            cu_seqlens_q=torch.from_numpy(cu).to(dev),
            seq_lens=torch.tensor([r.hi for r in rows], dtype=torch.int32, device=dev),
            page_tables=tuple(t.to(dev) for t in page_tables),
            slots=tuple(t.to(dev) for t in slots),
            max_seqlen_q=int(counts.max()),
        )
        positions = torch.from_numpy(tokens.position).to(dev)
        rope = self.target.rope_tables(positions, rows[0].h0.dtype)
        last = torch.from_numpy(cu[1:] - 1).to(dev, torch.int64)  # [B] frontier rows
        h = torch.cat([r.h0 for r in rows])  # [T, hidden]
        for j in range(self.k):
            ids = [t for r in rows for t in r.tokens[j : j + r.hi - r.lo]]  # t_{i+j+1}, i = lo .. hi-1
            h = self.heads.forward_layer(
                j, torch.tensor(ids, dtype=torch.int64, device=dev), h, positions, batch, self.kv,
                self.target.embed, rope,
            )  # fmt: skip
            # one row per sequence right after a layer call, on one CPU thread (``MTPHeads.forward_layer``)
            with torch_threads(1 if dev.type == "cpu" else torch.get_num_threads()):
                logits = self.target.compute_logits(h.index_select(0, last))  # [B, V] at the frontiers
                drafts = logits.argmax(-1).tolist()
            for b, r in enumerate(rows):
                if not r.drafting:
                    continue
                d = drafts[b]
                if not params_of(r.seq.sampling).greedy:
                    d, q = self.sampling.draw(r.seq, logits[b])
                    r.state.draft_probs.append(q)
                r.tokens.append(d)  # the next layer's input at the frontier
                r.state.draft_ids.append(d)
