"""Why Muon trains slowly on some CPUs: torch's Newton-Schulz runs in bfloat16.

    .venv/bin/python scripts/bench_muon_cpu.py [--threads 2] [--repeats 5]

torch.optim.Muon orthogonalizes each update with five Newton-Schulz iterations computed in
bfloat16 (torch/optim/_muon.py, `_zeropower_via_newtonschulz`: `grad.bfloat16()`). A CPU without
native bf16 matmul (torch.backends.cpu.get_cpu_capability() "AVX2": no AVX-512 BF16 / AMX) runs
those products far slower than float32. This times, at the shapes of the SmolLM2 EAGLE-3 draft's
matrices (H 576, I 1536, three aux layers into fc): (a) one Newton-Schulz iteration (the three
products torch's loop runs) in float32 and in bfloat16, and (b) a whole optimizer step of
torch.optim.Muon, of draftsmith's Muon with its Newton-Schulz in float32 (trainer/optim.py, what
muon_ns_dtype=auto takes on such a CPU) and of torch.optim.AdamW on the same parameter. Median of
--repeats after one warm-up, with the spread (min..max).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from trainer.optim import NS_COEFFICIENTS, Muon, newton_schulz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_matmul import timed  # noqa: E402 (the scripts folder, put on the path above)

# (name, rows, cols) of the draft layer's Muon matrices (trainer/drafts/eagle3.py)
SHAPES = (("fc", 576, 1728), ("q_proj", 576, 576), ("k_proj", 192, 576), ("gate_proj", 1536, 576),
          ("down_proj", 576, 1536))


def ns_iteration(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One Newton-Schulz iteration in `dtype`, as draftsmith's float32 Muon runs it (the same three
    products as torch/optim/_muon.py's loop, after the cast and the normalization)."""
    return newton_schulz(x, NS_COEFFICIENTS, 1, 1e-7, dtype)


def step_time(optimizer_cls, rows: int, cols: int, repeats: int, **kw) -> list[float]:
    p = torch.nn.Parameter(torch.randn(rows, cols) * 0.02)
    opt = optimizer_cls([p], lr=1e-3, **kw)

    def one():
        p.grad = torch.randn_like(p)
        opt.step()

    return timed(one, repeats)


def show(ts: list[float]) -> str:
    return f"{statistics.median(ts):.4f} s ({min(ts):.4f}..{max(ts):.4f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads, median of {args.repeats}")
    print(f"{'matrix':<10}{'shape':>12}  {'NS iter fp32':>28}{'NS iter bf16':>28}{'x':>6}"
          f"  {'torch Muon step':>28}{'Muon fp32 step':>28}{'AdamW step':>28}{'x':>7}{'fp32 x':>7}")
    for name, rows, cols in SHAPES:
        wide = torch.randn(min(rows, cols), max(rows, cols))
        wide /= wide.norm()
        f32 = timed(lambda w=wide: ns_iteration(w, torch.float32), args.repeats)
        half = wide.bfloat16()
        b16 = timed(lambda w=half: ns_iteration(w, torch.bfloat16), args.repeats)
        muon = step_time(torch.optim.Muon, rows, cols, args.repeats, adjust_lr_fn="match_rms_adamw")
        muon32 = step_time(Muon, rows, cols, args.repeats, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
        adamw = step_time(torch.optim.AdamW, rows, cols, args.repeats)
        m, m32, a = (statistics.median(t) for t in (muon, muon32, adamw))
        print(f"{name:<10}{f'{rows}x{cols}':>12}  {show(f32):>28}{show(b16):>28}"
              f"{statistics.median(b16) / statistics.median(f32):>6.0f}  {show(muon):>28}{show(muon32):>28}"
              f"{show(adamw):>28}{m / a:>7.0f}{m32 / a:>7.1f}")


if __name__ == "__main__":
    main()
