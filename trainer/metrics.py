"""Speculative-decoding metrics: τ, per-position acceptance, a training step's measures, the
agreement of two sampled runs, a context bucket's report. Serving decisions made from them (the
best N, the cost models, the context cut-off) are trainer/serving.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class StepMetrics:
    """What a draft's training step returns (the draft contract, trainer/drafts/__init__.py).
    Per-position tensors are [K] over the draft positions the algorithm trains (EAGLE-3: TTT
    steps; block drafts: block slots), kept on the device."""

    loss: torch.Tensor  # the objective, scalar
    position_loss: torch.Tensor  # [K] loss per position (detached)
    correct: torch.Tensor  # [K] positions where the draft's argmax is what greedy verification accepts
    count: torch.Tensor  # [K] positions counted
    # [K] Σ over the supervised rows of α = Σ_v min(p, q) (trainer/losses.py: a row's acceptance under
    # rejection sampling, teacher-forced), and [K] those rows; None where the step has no target p
    alpha: torch.Tensor | None = None
    alpha_rows: torch.Tensor | None = None


def simulated_tau(acc: list[float]) -> float:
    """τ = 1 + Σ_k Π_{j<=k} acc_j from conditional per-position accuracies: the expected
    accepted length with the bonus token, as vLLM counts it."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def expected_accepted_length(cumulative: list[float], n: int) -> float:
    """E[tokens per round] with n draft tokens = 1 + Σ_{k<=n} P(positions 1..k accepted)
    (Leviathan et al., 2023, §3.4; the 1 is the correction/bonus token)."""
    return 1.0 + sum(cumulative[:n])


def sampled_acceptance_agreement(theirs: tuple[list[int], int], ours: tuple[list[int], int],
                                 sigmas: float = 3.0) -> list[dict]:
    """Per draft position, whether two sampled runs accept at the same rate: (accepted at each
    position, rounds) on each side, the rates within `sigmas` standard errors of a pooled
    two-proportion test (the samples differ, so the rates agree in distribution, not count for
    count)."""
    (a_at, m1), (b_at, m2) = theirs, ours
    rows = []
    for k, (a, b) in enumerate(zip(a_at, b_at)):
        pooled = (a + b) / (m1 + m2)
        se = math.sqrt(pooled * (1 - pooled) * (1 / m1 + 1 / m2)) if 0 < pooled < 1 else 0.0
        diff = abs(a / m1 - b / m2)
        rows.append({"position": k + 1, "theirs": a / m1, "ours": b / m2, "counts": (a, m1, b, m2), "diff": diff,
                     "bound": sigmas * se, "agree": diff <= sigmas * se})
    return rows


def bucket_report(context: int, prompt_tokens: list[int], speculative, autoregressive) -> dict:
    """One context bucket of `draftsmith eval --context-buckets`: what eval reports for a whole
    run, for this bucket's prompts alone (trainer.speculative.DecodeStats of the speculative and
    the plain decode of them): τ, per-position acceptance, vLLM's counts, tokens/s and speedup."""
    sp, ar = speculative, autoregressive
    return {"context": context, "prompts": len(prompt_tokens), "prompt_tokens": [min(prompt_tokens),
                                                                                max(prompt_tokens)],
            "tau": sp.tau, "conditional_acceptance": sp.conditional_acceptance,
            "cumulative_acceptance": sp.cumulative_acceptance, "counts": sp.counts(),
            "tokens_per_s": sp.tokens_per_s, "plain_tokens_per_s": ar.tokens_per_s,
            "speedup": sp.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0}


