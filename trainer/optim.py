"""The optimizers and learning-rate schedules a draft trains with (train's `optimizer`,
`lr_schedule`): written from their sources, built from torch and transformers.

- adamw: torch.optim.AdamW over every trainable weight (Loshchilov & Hutter, 2019).
- muon: torch.optim.Muon (torch >= 2.9; Jordan et al., 2024, "Muon: an optimizer for hidden
  layers": momentum, then the update orthogonalized by Newton-Schulz iterations) over the 2-D
  weight matrices of the draft's layers, and AdamW over the rest: norms, biases, vectors, and the
  embedding-like and vocabulary matrices (the head, d2t-sized tables), as Muon's authors and
  speculators 0.9 (speculators/train/optimizers.py) do. torch's own Muon is used, not a copy:
  it is maintained with torch and runs wherever torch does (ROCm, CUDA, CPU). Muon needs each
  matrix whole, so it does not run under DeepSpeed ZeRO (which flattens and partitions
  gradients); DDP is fine.
- cosine: linear warmup, then cosine to 0 at the last step (transformers'
  get_cosine_schedule_with_warmup).
- wsd: warmup-stable-decay (Hu et al., 2024, MiniCPM §4.1): linear warmup, constant, then linear
  to 0 over the last `decay_fraction` of the steps (transformers' get_wsd_schedule). A checkpoint
  of the stable phase can be resumed with a smaller max_steps to decay there: one run, evaluated
  at several budgets.
"""

from __future__ import annotations

import torch
from transformers import get_cosine_schedule_with_warmup, get_wsd_schedule

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
MUON_LR_ADJUST = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
# 2-D weights that stay with AdamW under Muon: vocabulary-sized tables (their rows are tokens, not
# a linear map to orthogonalize), as in Muon's reference and speculators.
ADAMW_NAMES = ("embed_tokens", "lm_head", "markov_w1", "markov_w2")


def split_for_muon(named) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """Trainable (name, weight) pairs -> (Muon's: 2-D matrices, both sides > 1, not a vocabulary
    table; AdamW's: the rest)."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(n in name for n in ADAMW_NAMES)
        (muon if matrix else adamw).append((name, p))
    return muon, adamw


# CPU capabilities (torch.backends.cpu.get_cpu_capability) without a native bfloat16 matmul
SLOW_BF16 = ("DEFAULT", "NO AVX", "AVX2")


def muon_slow_here(device: torch.device) -> str | None:
    """One line when torch's Muon will crawl on this device, else None: its Newton-Schulz iteration
    runs in bfloat16 (torch/optim/_muon.py), which a CPU without native bf16 matmul computes 27-75x
    slower than float32 at the SmolLM2 draft's shapes (AVX2-only EPYC: scripts/bench_muon_cpu.py;
    training at 20 tokens/s instead of ~330, docs/benchmarks.md)."""
    if device.type != "cpu":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in SLOW_BF16:
        return None
    return (f"optimizer=muon on a CPU without bfloat16 matmul ({capability}): torch's Muon orthogonalizes in "
            "bfloat16, which such a CPU computes far slower than float32 (27-75x on an AVX2 EPYC), so each step is "
            "slow; optimizer=adamw learning_rate=0.0005 trains at full speed")


def build_optimizers(named, cfg) -> list[torch.optim.Optimizer]:
    """The optimizers of a run (`cfg`: TrainConfig): one AdamW, or Muon and AdamW side by side."""
    named = list(named)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)]
    muon, adamw = split_for_muon(named)
    out = []
    if muon:
        out.append(torch.optim.Muon([p for _, p in muon], lr=cfg.muon_lr or cfg.learning_rate,
                                    momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay,
                                    adjust_lr_fn=cfg.muon_adjust_lr_fn))
    if adamw:
        out.append(torch.optim.AdamW([p for _, p in adamw], lr=cfg.learning_rate, weight_decay=cfg.weight_decay))
    return out


def build_schedule(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """The learning-rate schedule of one optimizer over `total_steps` optimizer updates."""
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.lr_schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * total_steps))
        return get_wsd_schedule(optimizer, warmup, decay, num_training_steps=total_steps, decay_type="linear")
    return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
