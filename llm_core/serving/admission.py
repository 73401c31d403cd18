"""The LLM engine's admission by expected wait: when a new request's first token would come, from
the tokens of work waiting ahead of it and the tokens per busy second the engine has been serving.

A request's work is its prompt tokens left to compute plus the output tokens it is expected to
produce; the engine's rate is the same two kinds of tokens per second of its steps (idle time not
counted). Both are measured from what the engine actually does, so the mix (long prompts or long
answers, batched decode, speculative steps) is in the rate, not in a cost model. With continuous
batching a request starts once the requests waiting ahead of it have started, which takes about
their work at the engine's rate (the running ones free their slots at that pace); its first token
follows its own prompt:

    work(seq)   = prompt tokens left + expected output - output so far
    prompt left = prompt * (1 - hit)          for a request not started (hit: the prefix-cache
                = prompt - computed           share of recent prompts), else what is left; none
                                              for a prompt whose KV is imported
    expected    = max_new_tokens * fill       (fill: output / max_tokens of recent requests)
    wait(new)   = (work of the waiting requests + its prompt) / tokens per busy second

The deadline bounds that wait, the time to first token (what a streaming client's read timeout
measures, and the part the engine's load decides): a request's own decode is its max_tokens'
doing, and counting it would refuse every long answer whenever anything else runs.

The estimate learns its own error (``epd_common.admission.Lateness``): of the recent requests
admitted behind others with a measured rate, how much later their first token came than estimated;
the wait is scaled for the late tail and Retry-After by the median.

``fill`` keeps a client that asks for 4096 tokens and stops at 50 from counting as 4096, and
``hit`` a shared system prompt from counting as computed again (both seeded pessimistically, at 1
and 0: until requests finish, max_tokens is taken at its word and no prompt is cached).

Called under the engine's lock (the step thread observes, the event loop estimates).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from epd_common.admission import LATENESS_QUANTILE, Lateness, ServiceRate
from llm_core.request import Sequence


class WaitEstimate(NamedTuple):
    wait_s: float  # when the new request's first token would come
    start_s: float  # when it would start (the work ahead alone), scaled the same way
    tokens_ahead: float  # work of the requests waiting, in tokens
    prompt_own: float  # the new request's prompt tokens to compute
    tokens_per_s: float  # the rate (measured, or the seed)
    correction: float  # how much longer than estimated recent requests took (wait_s includes it)
    measured: bool  # the rate is measured (else the seed: its error says nothing of the model)
    retry_scale: float  # wait_s times this: the typical wait (median lateness), for Retry-After


class EngineAdmission:
    def __init__(
        self,
        seed_tokens_per_s: float,
        window_requests: int = 64,
        copied_in: Callable[[Sequence], bool] | None = None,
    ) -> None:
        """``copied_in(seq)``: the prompt's KV arrives by copy (an import from a prefill engine),
        so its prompt costs no work; default: never (the engine asks its KV manager's transfers)."""
        self.copied_in: Callable[[Sequence], bool] = copied_in or _never
        # steps: the last few seconds of them (ServiceRate's age bound), at least 8
        self.rate = ServiceRate(seed_tokens_per_s, min_samples=8)
        self._fills: deque[float] = deque(maxlen=window_requests)
        self._hits: deque[float] = deque(maxlen=window_requests)
        self.lateness = Lateness(window_requests)  # of first tokens against their estimates

    def fill(self) -> float:
        """Output tokens over max_tokens of recent finished requests (1.0 until one finished)."""
        return sum(self._fills) / len(self._fills) if self._fills else 1.0

    def hit(self) -> float:
        """The prefix-cache share of recent finished requests' prompts (0.0 until one finished)."""
        return sum(self._hits) / len(self._hits) if self._hits else 0.0

    def prompt_left(self, seq: Sequence, hit: float, copied_in: bool | None = None) -> float:
        """``copied_in``: whether ``seq``'s prompt KV is copied in (None: ask ``self.copied_in``)."""
        if self.copied_in(seq) if copied_in is None else copied_in:  # imported: copied, not computed
            return 0.0
        if seq.num_computed_tokens == 0:  # not started: its own prefix hit is not known yet
            return seq.num_prompt_tokens * (1.0 - hit)
        return max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)

    @staticmethod
    def output_left(seq: Sequence, fill: float) -> float:
        return max(max(seq.max_new_tokens * fill, 1.0) - len(seq.output_ids), 1.0)

    def work(self, seq: Sequence, fill: float, hit: float = 0.0) -> float:
        """Tokens ``seq`` still costs: its prompt left to compute and its expected output left."""
        return self.prompt_left(seq, hit) + self.output_left(seq, fill)

    def estimate(
        self, waiting: Iterable[Sequence], new: Sequence, new_copied_in: bool = False
    ) -> WaitEstimate:
        """When ``new``'s first token would come with ``waiting`` queued ahead of it
        (``new_copied_in``: its prompt's KV is imported, not computed)."""
        fill, hit = self.fill(), self.hit()
        ahead = sum(self.work(s, fill, hit) for s in waiting)
        prompt = self.prompt_left(new, hit, new_copied_in)
        per_s = self.rate.per_s()
        correction, typical = self.lateness.scale(LATENESS_QUANTILE, 0.5)
        return WaitEstimate(
            (ahead + prompt) / per_s * correction,
            ahead / per_s * correction,
            ahead,
            prompt,
            per_s,
            correction,
            self.rate.measured,
            typical / correction,
        )

    def correction(self, quantile: float = LATENESS_QUANTILE) -> float:
        """``quantile`` of actual / estimated over recent requests, within [1, 3] (1 until 8 are
        known)."""
        return self.lateness.scale(quantile)[0]

    def admitted(self, request: object, estimate: WaitEstimate, now: float) -> None:
        """``request`` was admitted behind others with ``estimate`` (what its first token is
        compared with; an estimate from the seed rate is not: it is a guess, not the model)."""
        if estimate.measured:
            self.lateness.admitted(request, estimate.wait_s / estimate.correction, now)

    def first_token(self, request: object, now: float) -> None:
        """``request`` produced its first token: how late was it against the estimate?"""
        self.lateness.done(request, now)

    def ended(self, request: object) -> None:
        """``request`` left the engine (before its first token, if it was aborted or failed)."""
        self.lateness.ended(request)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One step: prompt tokens computed plus tokens sampled, in ``seconds`` of busy time."""
        self.rate.observe(tokens, seconds)

    def observe_finished(self, seq: Sequence) -> None:
        """A request ended normally (aborted and failed ones say nothing of the output length)."""
        if seq.max_new_tokens > 0:
            self._fills.append(min(len(seq.output_ids) / seq.max_new_tokens, 1.0))
        if seq.num_prompt_tokens > 0:
            self._hits.append(min(seq.num_cached_tokens / seq.num_prompt_tokens, 1.0))


def _never(seq: Sequence) -> bool:
    return False
