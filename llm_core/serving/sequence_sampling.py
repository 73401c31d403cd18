"""Sampling per sequence: the ``Sampler`` plus each request's own random stream.

A seeded request keeps one generator, keyed by ``seq_id``, across steps, chunks and preemptions,
so its draws do not depend on its neighbours in a batch; an unseeded one draws from the sampler's
shared generator. The runner samples the target's rows through it, and the speculator draws a
sampled request's drafts and verifies them (rejection sampling) through the same generators.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from llm_core.request import RequestId, Sequence
from llm_core.serving.sampling import Sampler, SamplingParams, filtered_probs, params_of


class SequenceSampling:
    """The sampler and every running request's generator (made at its first sampled token)."""

    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler = sampler
        self.device = device
        self._generators: dict[RequestId, torch.Generator | None] = {}

    def sample(self, logits: Tensor, seqs: Seq[Sequence], rows_seq: Seq[int]) -> list[int]:
        """One token per row of ``logits`` [S, V], row i sampled as ``seqs[rows_seq[i]]`` asks."""
        params: list[SamplingParams] = []
        gens: list[torch.Generator | None] = []
        for b in rows_seq:
            s = seqs[b]
            p = params_of(s.sampling)
            params.append(p)
            gens.append(self._own(s, p))
        return self.sampler(logits, params, gens).tolist()  # type: ignore[no-any-return]

    def generator(self, s: Sequence) -> torch.Generator:
        """What ``s`` draws from: its own generator (seeded requests) or the sampler's shared one."""
        return self.sampler.generator_of(self._own(s, params_of(s.sampling)))

    def draw(self, s: Sequence, logits: Tensor) -> tuple[int, Tensor]:
        """A token drawn from ``s``'s filtered distribution q [V] of ``logits`` [V], and q (a draft
        keeps it: the verify step's rejection sampling needs it)."""
        q = filtered_probs(logits[None], [params_of(s.sampling)])[0]
        return int(torch.multinomial(q, 1, generator=self.generator(s))), q

    def release(self, seq_id: RequestId) -> None:
        self._generators.pop(seq_id, None)

    def _own(self, s: Sequence, p: SamplingParams) -> torch.Generator | None:
        try:
            return self._generators[s.seq_id]
        except KeyError:
            return self._generators.setdefault(s.seq_id, p.make_generator(self.device))
