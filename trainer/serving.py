"""Serving decisions from measured tokens/s: when one configuration is faster than another beyond
the noise of repeated servings, which to serve at a load, and the batch-size schedule vLLM takes.

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
    tied = [c for c in cells if not faster(fastest["runs"], c["runs"])]
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
