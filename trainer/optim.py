"""The optimizers and learning-rate schedules a draft trains with (train's `optimizer`,
`lr_schedule`): written from their sources, built from torch and transformers.

- adamw: torch.optim.AdamW over every trainable weight (Loshchilov & Hutter, 2019).
- muon: torch.optim.Muon (torch >= 2.9; Jordan et al., 2024, "Muon: an optimizer for hidden
  layers": momentum, then the update orthogonalized by Newton-Schulz iterations) over the 2-D
  weight matrices of the draft's layers, and AdamW over the rest: norms, biases, vectors, and the
  embedding-like and vocabulary matrices (the head, d2t-sized tables), as Muon's authors and
  speculators 0.9 (speculators/train/optimizers.py) do. torch's own Muon is used, not a copy:
  it is maintained with torch and runs wherever torch does (ROCm, CUDA, CPU). It orthogonalizes in
  bfloat16, which a CPU without bf16 matmul (AVX2) computes 23-75x slower than float32
  (scripts/bench_muon_cpu.py): there `muon_ns_dtype=auto` takes the same algorithm with the
  Newton-Schulz iteration in float32 (`Muon`, `muon_update`: written from Jordan et al.'s
  reference, equal to torch's step when run in bfloat16, tests/test_train.py). Muon needs each
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

import inspect

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


MUON_NS_DTYPES = ("auto", "bfloat16", "float32")
# torch's Muon's quintic Newton-Schulz coefficients (a, b, c), its default (Jordan et al., 2024)
NS_COEFFICIENTS = inspect.signature(torch.optim.Muon).parameters["ns_coefficients"].default
# CPU capabilities (torch.backends.cpu.get_cpu_capability) without a native bfloat16 matmul
SLOW_BF16 = ("DEFAULT", "NO AVX", "AVX2")
# /proc/cpuinfo flags (x86) and Features (arm64) of a native bfloat16 matmul
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is none (not Linux)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def slow_bf16(device: torch.device) -> str | None:
    """The CPU capability when `device` is a CPU without native bfloat16 matmul, else None: by its
    flags where /proc/cpuinfo has them (an AVX-512 CPU without AVX512_BF16 has none either), else
    by torch's capability."""
    if device.type != "cpu":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    slow = capability in SLOW_BF16 if flags is None else not flags & BF16_FLAGS
    return capability if slow else None


def muon_ns_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(the dtype Muon's Newton-Schulz iteration runs in, one line to print or None) for the
    `muon_ns_dtype` setting on `device`. torch's Muon runs it in bfloat16, which a CPU without
    native bf16 matmul computes 23-75x slower than float32 at the SmolLM2 draft's shapes (AVX2-only
    EPYC: scripts/bench_muon_cpu.py; training at 20 tokens/s instead of ~330, docs/benchmarks.md):
    auto takes float32 there, and says so, since the update's rounding differs from torch's."""
    capability = slow_bf16(device)
    if setting == "float32" or (setting == "auto" and capability):
        line = (f"optimizer=muon orthogonalizes in float32 on this CPU ({capability}: no bfloat16 matmul, where "
                "torch's bfloat16 Newton-Schulz is 23-75x slower); muon_ns_dtype=bfloat16 takes torch's own"
                if capability and setting == "auto" else None)
        return torch.float32, line
    if capability:
        return torch.bfloat16, (f"optimizer=muon with muon_ns_dtype=bfloat16 on a CPU without bfloat16 matmul "
                                f"({capability}): each step is slow (23-75x float32's Newton-Schulz on an AVX2 "
                                "EPYC); muon_ns_dtype=auto computes it in float32")
    return torch.bfloat16, None


def newton_schulz(g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """G's orthogonalization US'V^T (S' ~ 1) by the quintic Newton-Schulz iteration
    X <- aX + (bA + cA^2)X, A = XX^T, from X = G/||G||_F, in the wide orientation (Jordan et al., 2024,
    "Muon: an optimizer for hidden layers", github.com/KellerJordan/Muon muon.py
    `zeropower_via_newtonschulz5`), computed in `dtype`."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_update(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict, dtype: torch.dtype) -> None:
    """One Muon step of weight `p` in place (Jordan et al., 2024): momentum buffer B <- mu B + (1-mu) G,
    the update (1-mu) G + mu B with Nesterov else B, orthogonalized (`newton_schulz`), scaled by
    the learning-rate adjustment (original: sqrt(max(1, rows/cols)), Jordan et al.; match_rms_adamw:
    0.2 sqrt(max(rows, cols)), Liu et al., 2025, "Muon is Scalable for LLM Training" §2.2), after
    decoupled weight decay p <- (1 - lr wd) p."""
    mu, lr = group["momentum"], group["lr"]
    buf.lerp_(grad, 1 - mu)
    update = grad.lerp(buf, mu) if group["nesterov"] else buf
    update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
    rows, cols = p.shape
    adjust = group["adjust_lr_fn"]
    scale = 0.2 * max(rows, cols) ** 0.5 if adjust == "match_rms_adamw" else max(1, rows / cols) ** 0.5
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-lr * scale)


class Muon(torch.optim.Muon):
    """torch's Muon (its arguments, checks and state: checkpoints are interchangeable) with the
    Newton-Schulz iteration in `ns_dtype`: bfloat16 steps with torch's own code, float32 with
    `muon_update` (the same algorithm; a CPU without bf16 matmul computes it 23-75x faster)."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kw):
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            for p, g, buf in zip(params, grads, bufs):
                muon_update(p, g, buf, group, self.ns_dtype)
        return loss


def build_optimizers(named, cfg, ns_dtype: torch.dtype = torch.bfloat16) -> list[torch.optim.Optimizer]:
    """The optimizers of a run (`cfg`: TrainConfig): one AdamW, or Muon (its Newton-Schulz in
    `ns_dtype`: `muon_ns_dtype`) and AdamW side by side."""
    named = list(named)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)]
    muon, adamw = split_for_muon(named)
    out = []
    if muon:
        out.append(Muon([p for _, p in muon], lr=cfg.muon_lr or cfg.learning_rate, momentum=cfg.muon_momentum,
                        weight_decay=cfg.muon_weight_decay, adjust_lr_fn=cfg.muon_adjust_lr_fn, ns_dtype=ns_dtype))
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
