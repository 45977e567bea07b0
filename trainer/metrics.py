"""Speculative-decoding metrics: τ, per-position acceptance, and the best number of
draft tokens from measured acceptance and measured costs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.serving import faster as beats_by_noise


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


@dataclass
class CostModel:
    """Seconds per round with n draft tokens: the draft's cost, `draft_fixed + draft_per_token
    * n`, plus the target's verify(n), linear in the tokens scored and fitted through the two
    measured points (1 token: autoregressive decoding; n_max + 1: the speculative run).

    What a draft costs per round is measured, not assumed (`fit`): its commit (the work on
    the tokens just verified: EAGLE-3's draft forward over them, DFlash's context keys and
    values) is paid once a round whatever n is; its proposal is n chained steps for EAGLE-3
    and n-gram, but one forward over the whole block for DFlash and DSpark (flat in n)."""

    draft_fixed: float
    draft_per_token: float
    verify_one: float
    verify_max: float
    n_max: int

    @classmethod
    def fit(cls, autoregressive, speculative, n: int, parallel: bool) -> CostModel:
        """From two measured decodes (trainer.speculative.DecodeStats) of the same prompts:
        plain (`autoregressive`) and with the draft at n tokens a round. parallel: the draft
        proposes all n in one forward (its proposal time is per round, not per token)."""
        rounds = max(speculative.iterations, 1)
        propose = speculative.propose_s / rounds
        commit = speculative.commit_s / rounds  # begin included: paid once per prompt, spread over its rounds
        return cls(draft_fixed=commit + (propose if parallel else 0.0),
                   draft_per_token=0.0 if parallel else propose / max(n, 1),
                   verify_one=autoregressive.verify_s / max(autoregressive.iterations, 1),
                   verify_max=speculative.verify_s / rounds, n_max=n)

    def round_seconds(self, n: int) -> float:
        """n = 0 is plain decoding: no draft at all."""
        slope = (self.verify_max - self.verify_one) / self.n_max if self.n_max else 0.0
        draft = self.draft_fixed + self.draft_per_token * n if n else 0.0
        return draft + self.verify_one + slope * n


def best_num_draft_tokens(cumulative: list[float], conditional: list[float], cost: CostModel,
                          coverage: float = 1.0) -> dict:
    """Expected tokens/s for each n in 0..n_max (n = 0 is plain decoding), the best n, and
    the first position where acceptance collapses (conditional acceptance below half of
    position 1's, or below 0.1). coverage: the share of decoding steps with a proposal (a
    neural draft: 1; vLLM's n-gram: the steps whose context has a match; a step without one
    decodes one token at plain decoding's cost)."""
    curve = []
    for n in range(len(cumulative) + 1):
        tau = expected_accepted_length(cumulative, n)
        per_step = 1.0 + coverage * (tau - 1.0) if n else 1.0
        seconds = coverage * cost.round_seconds(n) + (1.0 - coverage) * cost.round_seconds(0) if n else \
            cost.round_seconds(0)
        curve.append({"n": n, "expected_tau": tau, "tokens_per_step": per_step, "tokens_per_s": per_step / seconds})
    best = max(curve, key=lambda c: c["tokens_per_s"])
    collapse = next((k + 1 for k, a in enumerate(conditional)
                     if a < 0.1 or (k > 0 and a < 0.5 * conditional[0])), None)
    return {"curve": curve, "best_n": best["n"], "best_tokens_per_s": best["tokens_per_s"],
            "collapse_position": collapse}


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


def speculation_cutoff(buckets: list[dict], faster=beats_by_noise) -> dict:
    """The context length above which serving without speculation is the choice, from per-bucket
    throughputs: `buckets` [{"context": L, "runs": [speculative tokens/s, ...], "plain_runs": [...]}]
    (repeated servings, or one figure each); `faster(a, b)`: whether runs a beat runs b beyond the
    noise (default trainer/serving.py's rule: >= 2% and Welch's t-test). Speculation pays at a
    bucket when it beats plain decoding by that rule; the simpler, plain decoding, is served
    otherwise. Returns
      pays_up_to   the largest bucket before the first one where speculation does not pay (the
                   cut-off: speculate at or below it); None where it does not pay at the shortest
      plain_from   that first bucket where it does not pay (the cut-off lies between the two, not
                   measured finer); None where it pays at every bucket measured
      regained     buckets above plain_from where it pays again (noise, or a draft that recovers;
                   the cut-off stays the first crossing: the conservative one)."""
    rows = sorted(buckets, key=lambda b: b["context"])
    pays = [faster(b["runs"], b["plain_runs"]) for b in rows]
    first = next((k for k, p in enumerate(pays) if not p), None)
    return {"pays_up_to": rows[first - 1]["context"] if first else (rows[-1]["context"] if first is None else None),
            "plain_from": rows[first]["context"] if first is not None else None,
            "regained": [b["context"] for b, p in zip(rows[first + 1:], pays[first + 1:]) if p]
            if first is not None else []}
