"""What a step costs, learned from the steps the engine runs, and the prefill budget that keeps a
step with a prompt's chunk from stalling the running streams.

    decode_s     exponential average of decode-only steps' seconds (no prefill token)
    token_s      exponential average of a prefill token's seconds: (step - decode_s) / its tokens

A running stream's next token waits for the whole step, so a step that also prefills n tokens
delays every decoding stream by about ``n * token_s``. ``prefill_budget`` gives the most prefill
tokens a step may take while streams decode: the step's predicted time stays within

    target = max(stall_factor * decode_s, floor_s)

(``EngineConfig.prefill_stall_factor``, off by default, and ``prefill_step_floor_ms``), as vLLM's fixed
``max_num_batched_tokens`` bounds it but following the measured cost, so the same setting holds on
a fast and a slow machine and for a small and a large model. With no stream decoding (nobody
waits on the step) or before both averages are measured the budget is not limited here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest step in each average: ~10 steps of memory, enough to follow a concurrency
# change within a second at decode pace and to smooth one noisy step.
ALPHA = 0.2


@dataclass
class StepCost:
    stall_factor: float  # a step with a chunk takes at most this many decode-only steps
    floor_s: float  # ... but may always take this long
    min_tokens: int = 16  # a prompt always advances by at least this many tokens a step
    decode_s: float | None = None
    token_s: float | None = None

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step's forward and sampling: ``decode_rows`` sequences decoding (or verifying
        drafts), ``prefill_tokens`` prompt tokens computed, in ``seconds``."""
        if prefill_tokens == 0:
            if decode_rows > 0:
                self.decode_s = _average(self.decode_s, seconds)
            return
        base = self.decode_s if decode_rows > 0 and self.decode_s is not None else 0.0
        self.token_s = _average(self.token_s, max(seconds - base, 0.0) / prefill_tokens)

    def target_s(self) -> float | None:
        """The time a step with a chunk may take, None until a decode-only step was measured."""
        if self.decode_s is None:
            return None
        return max(self.stall_factor * self.decode_s, self.floor_s)

    def prefill_budget(self, decode_rows: int, limit: int) -> int:
        """Prefill tokens a step with ``decode_rows`` decoding sequences may take, at most ``limit``
        (the token budget left after the decodes)."""
        target = self.target_s()
        if decode_rows == 0 or target is None or self.token_s is None or self.decode_s is None:
            return limit
        if self.token_s <= 0.0:
            return limit
        fits = int((target - self.decode_s) / self.token_s)
        return max(min(fits, limit), min(self.min_tokens, limit))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - ALPHA) * old + ALPHA * new
