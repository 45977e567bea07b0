"""Serving decisions from measured tokens/s and the cost models they rest on: when one configuration
is faster than another beyond the noise of repeated servings, which to serve at a load, the
batch-size schedule vLLM takes, the context length past which speculation stops paying; eval's
in-tree cost model (`CostModel`, `best_num_draft_tokens`) and compare's model of vLLM serving (its
step costs measured, continuous batching simulated: `step_costs`, `simulate`,
`predicted_and_measured`). `draftsmith eval` and `draftsmith compare` orchestrate; this computes.

The rule (README, "Deciding outside the noise"): configuration A is faster than B when the
difference of their mean tokens/s is at least MIN_GAIN of B's mean and Welch's t-test says so at
97.5% one-sided (Welch, 1947: the difference over its standard error sqrt(sa²/ra + sb²/rb), against
Student's t quantile at the Welch-Satterthwaite degrees of freedom: 4.30 for three servings each
with equal spreads, 1.96 for many). A difference inside that is no difference: the simpler
configuration is served (no speculation, then vLLM's n-gram, then a draft; BF16 before FP8; a
smaller N before a larger one). With one serving each (or a prediction, nothing served) there is
no spread to test: only MIN_GAIN applies.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from trainer.metrics import expected_accepted_length

MIN_GAIN = 0.02  # below 2% a gain is not worth a serving change, however steady the measurements
# Student's t, 97.5% one-sided, by degrees of freedom (larger: the last, 1.96 at infinity)
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 10: 2.23, 15: 2.13, 20: 2.09,
         30: 2.04, 60: 2.00}


# vLLM's own speculative-config options that `draftsmith compare` serves as candidates of their own,
# each beside the same draft without it, where the installed vLLM has them (checked against its own
# SpeculativeConfig fields and the model runner that would read them, at serve time:
# trainer/vllm/runners/vllm_generate.py `knob_unavailable`; no version table). Per knob: the value
# served, whether only sampled serving can change it (at temperature 0 a draft token drawn from q is
# q's argmax and greedy verification never reads q), and whether the in-tree decoder computes it
# (then vLLM's counts are held to the in-tree decoder's; else only its outputs are checked).
# Where each is read (vLLM sources): draft_sample_method: 0.32 vllm/v1/spec_decode/llm_base_proposer.py
# (V1) and vllm/v1/worker/gpu/spec_decode/speculator.py (V2), 0.34 the latter only;
# enable_adaptive_verification: the V2 runner only (vllm/v1/worker/gpu/spec_decode/, 0.32 and 0.34;
# 0.32's field says "only supported for method='dspark'", 0.34's speculator configs take it for
# every method); draft_lm_head_quantization: 0.34 only (vllm/config/speculative.py), for drafters
# that share the target's lm_head (vllm/v1/worker/gpu/spec_decode/eagle/utils.py
# `share_target_lm_head`: EAGLE/EAGLE-3, MTP, DSpark; fp8 here, nvfp4 needs a Blackwell GPU).
KNOBS = {"draft_sample_method": {"value": "probabilistic", "sampled_only": True, "in_tree": True},
         "enable_adaptive_verification": {"value": True, "sampled_only": False, "in_tree": False},
         "draft_lm_head_quantization": {"value": "fp8", "sampled_only": False, "in_tree": False}}


def spread(runs: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of repeated measurements; the error is 0 for one."""
    mean = statistics.fmean(runs)
    if len(runs) < 2:
        return mean, 0.0
    return mean, statistics.stdev(runs) / math.sqrt(len(runs))


def t_quantile(df: float) -> float:
    """Student's t at 97.5% for `df` degrees of freedom (the table's entry at or below df: conservative)."""
    below = [k for k in T_975 if k <= df]
    return T_975[max(below)] if below else T_975[1]


def faster(a: list[float], b: list[float]) -> bool:
    """A's repeated tokens/s beat B's beyond the noise (the module docstring's rule)."""
    (ma, sa), (mb, sb) = spread(a), spread(b)
    if ma - mb < MIN_GAIN * mb:
        return False
    se = math.hypot(sa, sb)
    if se == 0:  # nothing to test: one serving each, or identical repeats
        return True
    # Welch-Satterthwaite: the degrees of freedom of the difference's standard error
    df = se**4 / sum(s**4 / (len(r) - 1) for s, r in ((sa, a), (sb, b)) if len(r) > 1 and s > 0)
    return (ma - mb) / se > (t_quantile(df) if len(a) > 1 or len(b) > 1 else 0)


def choose(cells: list[dict], simpler) -> tuple[dict, dict, str]:
    """Among `cells` ({"runs": [tokens/s, ...], ...} each), the one to serve: the simplest
    (`simpler`: a sort key, smaller = simpler) that no other cell beats beyond the noise.
    Returns (chosen, the fastest measured, why)."""
    fastest = max(cells, key=lambda c: spread(c["runs"])[0])
    # unbeaten by any cell, not only by the fastest: a noisy fastest can tie a cell that a steadier,
    # slower one beats. Never empty: `faster` needs a higher mean, so the fastest is unbeaten.
    tied = [c for c in cells if not any(faster(o["runs"], c["runs"]) for o in cells)]
    chosen = min(tied, key=simpler)
    if chosen is fastest:
        why = "the fastest, beyond the noise of every simpler configuration" if len(tied) == 1 else "the fastest"
    else:
        why = "within the noise of the fastest measured, and simpler"
    return chosen, fastest, why


def schedule(loads: list[int], n_at: dict[int, int]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` from the N to serve at each measured load
    (0: no speculation at that batch size): inclusive [first, last, N] ranges that start at 1 (vLLM
    refuses any other: vllm/v1/spec_decode/dynamic/utils.py, `validate_and_normalize_dynamic_sd_schedule`,
    the same file in vLLM 0.32 and 0.34), each load's N from it up to the next load, the last carried
    on. vLLM 0.34 drops the schedule, silently, when data parallel > 1 (vllm/config/vllm.py
    `_maybe_disable_dynamic_sd_for_data_parallel`): there the largest N serves every load."""
    loads = sorted(loads)
    starts = [1] + loads[1:]
    return [[start, (loads[i + 1] - 1) if i + 1 < len(loads) else loads[-1], n_at[load]]
            for i, (start, load) in enumerate(zip(starts, loads))]


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


def speculation_cutoff(buckets: list[dict], faster=faster) -> dict:
    """The context length above which serving without speculation is the choice, from per-bucket
    throughputs: `buckets` [{"context": L, "runs": [speculative tokens/s, ...], "plain_runs": [...]}]
    (repeated servings, or one figure each); `faster(a, b)`: whether runs a beat runs b beyond the
    noise (default this module's rule: >= 2% and Welch's t-test). Speculation pays at a
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



def wider_costs_more(seconds: dict[int, float]) -> dict[int, float]:
    """A forward over more tokens never costs less than one over fewer (the same rows, the same
    context): timing noise below that is taken out (a running maximum over the widths), so that a
    draft that accepts nothing can never look faster than no speculation."""
    out, most = {}, 0.0
    for w in sorted(seconds):
        most = max(most, seconds[w])
        out[w] = most
    return out


def predicted_and_measured(name, n, servings, per_prompt, lengths) -> list[dict]:
    """One (candidate, N) at each concurrency: the prediction from vLLM's step costs (measured over
    all its servings) and the in-tree steps per prompt, and the served tokens/s of every repeated
    serving (their mean, its standard error; the prediction's error against the mean)."""
    step_s, prompt_s = step_costs(servings)
    requests = [(steps + 1, length) for (steps, _), length in zip(per_prompt, lengths)]  # + the prompt's step
    tokens = sum(t for _, t in per_prompt)
    rows = []
    for b in dict.fromkeys(row["concurrency"] for row in servings):
        runs = [row["tokens"] / row["seconds"] for row in servings if row["concurrency"] == b]
        predicted = tokens / simulate(requests, b, step_s, prompt_s)
        mean, se = spread(runs)
        rows.append({"candidate": name, "n": n, "concurrency": b, "tokens_per_s": predicted,
                     "measured_tokens_per_s": mean, "measured_runs": runs, "measured_se": se,
                     "error": predicted / mean - 1})
    return rows


def step_costs(servings) -> tuple[dict[int, float], float]:
    """vLLM's seconds per engine step with k requests in flight (the mean over the steps that sent
    no prompt, plus the client's own time between steps, spread over every step) and per prompt
    token sent (the steps that sent one: their excess over that, per token). Means, not medians:
    served tokens/s is total tokens over total time, so a slow step counts at its full length."""
    by_k: dict[int, list[float]] = {}
    for row in servings:
        for seconds, k, sent in row["steps"]:
            if not sent:
                by_k.setdefault(k, []).append(seconds)
    steps = [step for row in servings for step in row["steps"]]
    client_s = max(0.0, sum(row["seconds"] for row in servings) - sum(s for s, _, _ in steps)) / len(steps)
    step_s = {k: statistics.fmean(v) + client_s for k, v in sorted(by_k.items())}
    sent = sum(n for _, _, n in steps)
    excess = sum(seconds + client_s - step_seconds_at(step_s, k) for seconds, k, n in steps if n)
    return step_s, max(0.0, excess / sent) if sent else 0.0


def step_seconds_at(step_s: dict[int, float], k: int) -> float:
    """The step time with k in flight: measured, else linear between the nearest measured (or the nearest)."""
    if k in step_s:
        return step_s[k]
    below = [j for j in step_s if j < k]
    above = [j for j in step_s if j > k]
    if not below or not above:
        return step_s[max(below) if below else min(above)]
    lo, hi = max(below), min(above)
    return step_s[lo] + (step_s[hi] - step_s[lo]) * (k - lo) / (hi - lo)


def simulate(requests: list[tuple[int, int]], b: int, step_s: dict[int, float], prompt_s: float) -> float:
    """Seconds to serve `requests` ((engine steps, prompt tokens) each) as a client keeping b in
    flight: every engine step advances each request in flight by one step and costs the step time
    at that many requests, plus the prompt cost of the requests sent before it (vLLM's continuous
    batching, its costs measured)."""
    pending, running, seconds = list(requests), [], 0.0
    while pending or running:
        sent = 0
        while pending and len(running) < b:
            steps, prompt = pending.pop(0)
            running.append(steps)
            sent += prompt
        seconds += step_seconds_at(step_s, len(running)) + sent * prompt_s
        running = [r - 1 for r in running if r > 1]
    return seconds


def runs_of(p: dict) -> list[float]:
    """The tokens/s a row was decided on: every serving of it, else its prediction (--no-vllm)."""
    return p.get("measured_runs") or [p.get("measured_tokens_per_s", p["tokens_per_s"])]


def simplicity(candidates):
    """A sort key, smaller = simpler: no speculation, vLLM's n-gram, a BF16 draft, an FP8 one; a draft
    without a vLLM knob before one with it; then N."""
    by_name = {c["name"]: c for c in candidates}

    def key(p: dict) -> tuple:
        c = by_name.get(p["candidate"]) or {}
        kind = 0 if p["n"] == 0 else 1 if c.get("method") == "ngram" else 3 if c.get("fp8") else 2
        return kind, len(c.get("knob") or {}), p["n"]

    return key


def eligible(predictions, candidates, b: int) -> list[dict]:
    """The rows at load b a recommendation may take: served (not in-tree only), not excluded."""
    out = {c["name"] for c in candidates if c.get("excluded")}
    return [p for p in predictions if p["concurrency"] == b and not p.get("in_tree") and p["candidate"] not in out]


def recommend(predictions, candidates, concurrency) -> dict:
    """For each concurrency what to serve (trainer/py `choose`: the simplest configuration
    no other beats beyond the noise of its repeated servings) and the runner-up (the fastest other
    candidate), each with its --speculative-config (None: serve without speculation). A candidate
    the installed vLLM cannot serve, or that served unfaithfully (`exclude_unfaithful`), is never
    recommended."""
    configs = {c["name"]: c["config"] for c in candidates}
    out = {}
    for b in concurrency:
        cells = [{**p, "runs": runs_of(p)} for p in eligible(predictions, candidates, b)]
        best, fastest, why = choose(cells, simplicity(candidates))
        others = [p for p in cells if p["candidate"] != best["candidate"]]
        runner = max(others, key=lambda p: spread(p["runs"])[0]) if others else None

        def entry(p):
            if p is None:
                return None
            config = None if p["n"] == 0 else {**configs[p["candidate"]], "num_speculative_tokens": p["n"]}
            return {**{k: v for k, v in p.items() if k != "runs"}, "config": config}

        out[b] = {"best": entry(best), "runner_up": entry(runner), "why": why,
                  "fastest": {"candidate": fastest["candidate"], "n": fastest["n"]}}
    return out


def draft_or_plain(c: dict, concurrency: list[int], candidates, predictions,
                   knobs: bool = False) -> dict[int, tuple[dict, str]]:
    """Per load, this draft (at its N; with `knobs`, also with each vLLM knob served) or plain
    decoding, whichever trainer/py's rule serves between them alone, and why; plain decoding
    wherever the draft was excluded or not served."""
    mine = {c["name"], "no speculation"} | ({x["name"] for x in candidates if x.get("base") == c["name"]}
                                           if knobs else set())
    out = {}
    for b in concurrency:
        cells = [{**p, "runs": runs_of(p)} for p in eligible(predictions, candidates, b) if p["candidate"] in mine]
        chosen, _, why = choose(cells, simplicity(candidates))
        out[b] = ({k: v for k, v in chosen.items() if k != "runs"}, why)
    return out


def dynamic_configs(concurrency: list[int], candidates, predictions) -> dict:
    """Per draft served faithfully, one --speculative-config for every load: at each concurrency the
    N it is served at (its own best, the simplest within the noise; 0 where serving without
    speculation is not beaten beyond the noise) as vLLM's batch-size schedule
    (`num_speculative_tokens_per_batch_size`: ranges from 1, trainer/py `schedule`)."""
    out = {}
    for c in candidates:
        if c["method"] == "ngram" or c.get("excluded") or c.get("not_served"):
            continue
        n_at = {b: row["n"] for b, (row, _) in draft_or_plain(c, concurrency, candidates, predictions).items()}
        if not any(n_at.values()):  # never faster than plain decoding: no schedule to serve it with
            continue
        out[c["name"]] = {**c["config"], "num_speculative_tokens": max(n_at.values()),
                          "num_speculative_tokens_per_batch_size": schedule(concurrency, n_at)}
    return out
