"""Train multi-token-prediction heads for a model that has none: a short, deterministic distillation
on the model's OWN greedy continuations (how the embedded default gets its 3 heads).

Data. ``num_prompts`` prompts of random byte ids (0..255: the byte-level tokenizer's plain bytes,
never a special id) from a seeded ``torch.Generator``, each extended greedily by the target for
``new_tokens`` tokens: the dense reference's argmax (``DecoderForCausalLM.forward_dense``), found
quickly with a batched paged loop and then checked, sequence by sequence, against one dense pass
(a near-tie decided the other way by the paged kernels is regenerated with the dense path from
there, so the ids are exactly the dense greedy ones). The same dense pass gives h^0, the target's
final-normed hidden state at every position.

Training (the agreed chain, DeepSeek-V3 style, teacher-forced). For a sequence t_0 .. t_{S-1},
head j runs over positions i = 0 .. S-j-2 with token t_{i+j+1} and hidden h^j_i, where h^0 is the
target's and h^{j+1} is head j's output over the same sequence (gradients flow down the chain, as
when the heads are trained jointly); its logits (the target's lm_head) at i are scored by
cross-entropy against t_{i+j+2} wherever that token is one the target generated (i + j + 2 >= P,
P the prompt length: a random prompt byte is not predictable). The loss is the sum over heads of
each head's mean. Adam, a fixed number of steps, ``batch_size`` sequences per step in a seeded
order.

Acceptance (``DistillReport.acceptance``), on held-out prompts: a chain of k drafts from position
f (h^0_f predicted the last known token t_{f+1}) is d_1 = head 0 (t_{f+1}, h^0_f), d_2 = head 1
(d_1, h^1_f), ...; its accepted length is 1 (the target's own token) plus the drafts that equal
the target's greedy tokens t_{f+2}, t_{f+3}, ... up to the first miss. Head j's rows at earlier
positions i hold the known tokens t_{i+j+1}, and the chain's drafts where those are not known yet
(rows f-j+1 .. f-1; ``draft_chain_dense`` runs such a chain explicitly). Until the first miss
every draft equals the target's token, so the heads' inputs equal the teacher-forced ones and all
chains are read off one teacher-forced pass per sequence (the tests check the two agree). Every f
from P - 1 (the first decode step) to S - 2 - max(k) counts.

Determinism. Everything is seeded and runs with ``recipe.threads`` torch threads (1 by default),
so a machine gives the same heads every time. BLAS and vector-unit differences between machines
may change the trained weights in their last bits; that changes which drafts are accepted, never
the target's output (drafts are only ever verified by the target).

What to expect from the default recipe (~45 s on 2 CPU cores): k=1 acceptance ~1.45 held-out
(random heads: 1.0). For scale: on the same data a head that only repeats its input hidden's
choice (eh_proj = [0 | I], zero residual branches) scores ~1.6 untrained, because the random
target mostly repeats itself; cross-entropy moves a head started there away from it (to ~1.45),
and matching the target's logits instead keeps it at ~1.6: neither beat the plain copy in this
budget, so the heads are trained from a random init, as the objective above describes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from epd_common.runtime import torch_threads
from llm_core.caches.kv_pool import KVLayout, PagedKVCache
from llm_core.kernels.attention_batch import build_attention_batch
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.mtp import MTPHeads
from llm_core.models.random_init import init_random_weights

# Prompt ids are drawn from the plain bytes of the byte-level tokenizer (ids 256.. are its
# specials and unused rows): a prompt never contains eos or a chat-template marker.
PROMPT_ID_LIMIT = 256
# Draft-chain lengths the report measures.
CHAIN_LENGTHS = (1, 2, 3)
_PAGE = 16


@dataclass(frozen=True)
class DistillRecipe:
    """Everything the trained heads depend on besides the target and the seed."""

    # Many short sequences rather than a few long ones: a random model's greedy continuation soon
    # repeats a few tokens, and with few sequences the heads learn those tokens, not the model
    # (measured: 48 prompts x 64 tokens reach k=1 acceptance ~1.15 held-out, 512 x 32 ~1.45).
    num_prompts: int = 512  # training sequences
    num_eval_prompts: int = 32  # held-out sequences for the acceptance figures
    prompt_len: int = 16  # random byte ids per prompt
    new_tokens: int = 32  # greedy tokens the target appends to each prompt
    steps: int = 160  # Adam steps
    batch_size: int = 8  # sequences per step
    loss_sample: int = 64  # training sequences the reported start / end losses average over
    lr: float = 3e-3
    init_std: float = 0.02  # normal(0, std) matrices and sinks, unit norms (as the target's init)
    threads: int = 1  # torch threads while distilling (fixed, for run-to-run identical weights)


@dataclass(frozen=True)
class DistillReport:
    """What a distillation did and how well the heads draft (JSON-able: ``to_json``).

    ``loss_start`` / ``loss_end``: per head, the mean cross-entropy over the continuation region of
    the first ``loss_sample`` training sequences, before the first step and after the last;
    ``held_out_loss``: the same on the held-out sequences at the end. ``acceptance_start`` /
    ``acceptance``: k -> mean accepted length (1 + accepted drafts) of k-draft chains on the
    held-out sequences, with the heads as given and as trained. ``positions``: chain starts
    measured. ``regenerated``: sequences whose fast greedy ids the dense check corrected.
    ``seconds``: wall time per phase (machine-dependent; not part of the trained result)."""

    seed: int
    recipe: DistillRecipe
    loss_start: list[float]
    loss_end: list[float]
    held_out_loss: list[float]
    acceptance_start: dict[int, float]
    acceptance: dict[int, float]
    positions: int
    regenerated: int
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "recipe": dataclasses.asdict(self.recipe),
            "loss_start": self.loss_start,
            "loss_end": self.loss_end,
            "held_out_loss": self.held_out_loss,
            "acceptance_start": {str(k): v for k, v in self.acceptance_start.items()},
            "acceptance": {str(k): v for k, v in self.acceptance.items()},
            "positions": self.positions,
            "regenerated": self.regenerated,
            "seconds": self.seconds,
        }


def init_heads(heads: MTPHeads, seed: int, std: float = 0.02) -> None:
    """Deterministic random init: unit norm weights, normal(0, std) for everything else."""
    init_random_weights(heads, seed, std)


# ---- the target ----------------------------------------------------------------------------------


@torch.no_grad()
def dense_hidden(model: DecoderForCausalLM, ids: Tensor) -> Tensor:
    """ids [S] -> the target's final-normed hidden [S, hidden]: ``forward_dense`` without its last
    step (the same modules and arguments, so ``lm_head`` of this is exactly its logits)."""
    positions = torch.arange(ids.shape[0], device=ids.device)
    x, residual = model.embed(ids), None
    for layer in model.model.decoder_layers():
        x, residual = layer.forward_dense(x, residual, positions)
    return model._final_norm(x, residual)


def _logits(model: DecoderForCausalLM, hidden: Tensor) -> Tensor:
    """hidden [n, hidden] -> fp32 logits [n, vocab], as ``compute_logits`` (which is inference-only),
    differentiable in ``hidden``."""
    return F.linear(hidden, model.lm_head.weight).float()


@torch.inference_mode()
def _paged_greedy(model: DecoderForCausalLM, prompts: Tensor, new_tokens: int) -> Tensor:
    """prompts [N, P] -> [N, P + new_tokens]: all N extended together through the paged forward (one
    prefill step, then one decode step per token), each sequence in its own run of pages."""
    n, p = prompts.shape
    total = p + new_tokens
    pages = -(-total // _PAGE)
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    layout = KVLayout.from_model_config(model.config, dtype)
    kv = PagedKVCache(layout, _PAGE, dtype, device, group_pages=n * pages)
    table = [list(range(b * pages, (b + 1) * pages)) for b in range(n)]
    seqs = prompts.clone()
    out = [seqs]
    lens, news, ids = [p] * n, [p] * n, seqs.reshape(-1)  # prefill: the N prompts packed
    for _ in range(new_tokens):
        batch = build_attention_batch(lens, news, [table] * len(kv.groups), _PAGE, device)
        hidden = model(ids, batch.positions(), batch, kv)  # [T, hidden]
        last = batch.cu_seqlens_q[1:].to(torch.int64) - 1  # [N] each sequence's last row
        ids = model.compute_logits(hidden[last]).argmax(-1)  # [N]
        out.append(ids[:, None])
        lens, news = [x + 1 for x in lens], [1] * n
    return torch.cat(out, dim=1)


@torch.no_grad()
def greedy_sequences(
    model: DecoderForCausalLM, prompts: Tensor, new_tokens: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """prompts [N, P] -> (ids [N, S], h0 [N, S, hidden], greedy [N, S], regenerated), S = P +
    new_tokens: the dense reference's greedy continuations, its final-normed hidden states, and its
    greedy choice after every prefix (greedy[:, p] follows t_0 .. t_p: ids[:, p + 1] from p = P - 1
    on). ``regenerated`` counts sequences where the paged guess was corrected."""
    p = prompts.shape[1]
    guess = _paged_greedy(model, prompts, new_tokens)
    ids, hiddens, choices, regenerated = [], [], [], 0
    for row in guess:
        seq = row.clone()
        h = dense_hidden(model, seq)
        pred = _logits(model, h[p - 1 : -1]).argmax(-1)  # [new_tokens]: the dense greedy choices
        wrong = (pred != seq[p:]).nonzero()
        if wrong.numel():
            regenerated += 1
            for q in range(p + int(wrong[0]), seq.shape[0]):  # dense greedy from the first difference
                seq[q] = _logits(model, dense_hidden(model, seq[:q])[-1:]).argmax(-1)[0]
            h = dense_hidden(model, seq)
        ids.append(seq)
        hiddens.append(h)
        choices.append(_logits(model, h).argmax(-1))
    return torch.stack(ids), torch.stack(hiddens), torch.stack(choices), regenerated


# ---- the heads -----------------------------------------------------------------------------------


def chain_logits(model: DecoderForCausalLM, heads: MTPHeads, ids: Tensor, h0: Tensor) -> list[Tensor]:
    """Teacher-forced chain over one sequence: ids [S], h0 [S, hidden] -> per head j the logits
    [S - j - 1, vocab] at positions i = 0 .. S-j-2 (predicting t_{i+j+2}). Differentiable in the
    heads' parameters when autograd is on."""
    s = ids.shape[0]
    out, prev = [], h0
    for j in range(heads.num_layers):
        n = s - j - 1  # positions with a known input token t_{i+j+1}
        hidden = heads.forward_layer_dense(j, ids[j + 1 :], prev[:n], model.embed, model.rope_tables)
        out.append(_logits(model, hidden))  # [n, vocab]
        prev = hidden  # h^{j+1} [n, hidden]
    return out


def _head_losses(logits: list[Tensor], greedy: Tensor, first: list[int]) -> list[Tensor]:
    """Per head j the mean cross-entropy of rows i >= first[j] against the target's greedy token
    after t_0 .. t_{i+j+1} (greedy [S]; t_{i+j+2} itself wherever the target generated it)."""
    return [F.cross_entropy(lg[first[j] :], greedy[first[j] + j + 1 :]) for j, lg in enumerate(logits)]


def _generated_rows(num_heads: int, prompt_len: int) -> list[int]:
    """Per head j the first row whose target t_{i+j+2} the target generated (i + j + 2 >= P)."""
    return [max(0, prompt_len - j - 2) for j in range(num_heads)]


@torch.no_grad()
def _mean_losses(
    model: DecoderForCausalLM, heads: MTPHeads, ids: Tensor, h0: Tensor, greedy: Tensor, prompt_len: int
) -> list[float]:
    """Per head the mean cross-entropy over the continuation region of sequences ids [N, S]."""
    first = _generated_rows(heads.num_layers, prompt_len)
    per_seq = [
        _head_losses(chain_logits(model, heads, s, h), g, first)
        for s, h, g in zip(ids, h0, greedy, strict=True)
    ]
    return [float(torch.stack([x[j] for x in per_seq]).mean()) for j in range(heads.num_layers)]


@torch.no_grad()
def acceptance_lengths(
    model: DecoderForCausalLM, heads: MTPHeads, ids: Tensor, h0: Tensor, prompt_len: int
) -> tuple[dict[int, float], int]:
    """Mean accepted length (1 + drafts accepted up to the first miss) of k-draft chains for
    k in CHAIN_LENGTHS (capped at the head count) from every position f in P-1 .. S-2-max(k), over
    sequences ids [N, S] with target hidden h0 [N, S, hidden]; and how many chains that is per k."""
    ks = [k for k in CHAIN_LENGTHS if k <= heads.num_layers]
    kmax = max(ks)
    s = ids.shape[1]
    starts = torch.arange(prompt_len - 1, s - 1 - kmax)  # f
    hits = []  # per sequence: [F, kmax] bool, draft j+1 of the chain at f equals t_{f+j+2}
    for seq, h in zip(ids, h0, strict=True):
        logits = chain_logits(model, heads, seq, h)
        hits.append(
            torch.stack([logits[j][starts].argmax(-1) == seq[starts + j + 2] for j in range(kmax)], 1)
        )
    run = torch.cat(hits).to(torch.int64).cumprod(dim=1)  # [N * F, kmax]: 1 while no draft missed
    return {k: 1.0 + float(run[:, :k].sum(1).double().mean()) for k in ks}, int(run.shape[0])


@torch.no_grad()
def draft_chain_dense(model: DecoderForCausalLM, heads: MTPHeads, ids: Tensor, k: int) -> list[int]:
    """The k drafts d_1 .. d_k after ids [n] (n >= 2), chained from f = n - 2, every head run densely
    over positions 0 .. f. Head j's row i takes token t_{i+j+1}: the known one while i+j+1 <= n-1,
    else the chain's guess of it (d_{i+j+2-n}: rows f-j+1 .. f, whose tokens are not known yet),
    and the hidden h^j_i from head j-1 over the same rows (h^0: the target's)."""
    f = ids.shape[0] - 2
    h = dense_hidden(model, ids)[: f + 1]  # h^0 [f+1, hidden]
    ext = ids.clone()  # t_0 .. t_{n-1}, then the drafts as they come
    for j in range(k):
        tokens = ext[j + 1 : f + j + 2]  # [f+1]: row i's token t_{i+j+1} (or its draft)
        h = heads.forward_layer_dense(j, tokens, h, model.embed, model.rope_tables)  # h^{j+1} [f+1, hidden]
        ext = torch.cat([ext, _logits(model, h[-1:]).argmax(-1)])  # d_{j+1}, a guess of t_{f+j+2}
    return ext[ids.shape[0] :].tolist()


def distill_mtp_heads(
    model: DecoderForCausalLM,
    heads: MTPHeads,
    seed: int,
    recipe: DistillRecipe = DistillRecipe(),
    *,
    init: bool = True,
) -> DistillReport:
    """Train ``heads`` in place on ``model``'s greedy continuations (see the module docstring) and
    report losses and held-out acceptance. ``init``: first give the heads the seeded random init
    (False: start from their current weights). ``model`` is only read. Returns with the heads in
    eval mode and without gradients."""
    assert heads.config.hidden_size == model.config.hidden_size
    assert recipe.prompt_len >= 2 and recipe.new_tokens > max(CHAIN_LENGTHS) + 1
    times: dict[str, float] = {}
    with torch_threads(recipe.threads):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        if init:
            init_heads(heads, int(torch.randint(0, 2**31 - 1, (1,), generator=gen)), recipe.init_std)
        shape = (recipe.num_prompts + recipe.num_eval_prompts, recipe.prompt_len)
        prompts = torch.randint(0, PROMPT_ID_LIMIT, shape, generator=gen).to(model.lm_head.weight.device)
        ids, h0, greedy, regenerated = greedy_sequences(model, prompts, recipe.new_tokens)
        n, p = recipe.num_prompts, recipe.prompt_len
        held_out = (ids[n:], h0[n:], greedy[n:])
        t1 = time.perf_counter()
        times["generate"] = t1 - t0

        heads.train().requires_grad_(True)
        m = min(n, recipe.loss_sample)
        sample = (ids[:m], h0[:m], greedy[:m])
        loss_start = _mean_losses(model, heads, *sample, p)
        acceptance_start, _ = acceptance_lengths(model, heads, held_out[0], held_out[1], p)
        t2 = time.perf_counter()
        times["measure_start"] = t2 - t1

        first = _generated_rows(heads.num_layers, p)
        opt = torch.optim.Adam(heads.parameters(), lr=recipe.lr)
        order: list[int] = []
        for _ in range(recipe.steps):
            opt.zero_grad(set_to_none=True)
            total = torch.zeros((), device=prompts.device)
            for _ in range(recipe.batch_size):
                if not order:  # a fresh seeded permutation per pass over the training set
                    order = torch.randperm(n, generator=gen).tolist()
                b = order.pop()
                logits = chain_logits(model, heads, ids[b], h0[b])
                total = total + torch.stack(_head_losses(logits, greedy[b], first)).sum()
            (total / recipe.batch_size).backward()
            opt.step()
        t3 = time.perf_counter()
        times["train"] = t3 - t2

        heads.eval().requires_grad_(False)
        loss_end = _mean_losses(model, heads, *sample, p)
        held_out_loss = _mean_losses(model, heads, *held_out, p)
        acceptance, positions = acceptance_lengths(model, heads, held_out[0], held_out[1], p)
        times["measure_end"] = time.perf_counter() - t3
    times["total"] = time.perf_counter() - t0
    return DistillReport(
        seed=seed,
        recipe=recipe,
        loss_start=loss_start,
        loss_end=loss_end,
        held_out_loss=held_out_loss,
        acceptance_start=acceptance_start,
        acceptance=acceptance,
        positions=positions,
        regenerated=regenerated,
        seconds={k: round(v, 3) for k, v in times.items()},
    )
