"""Benchmark: capture throughput vs a bare target forward over the same batches, and
bytes/token on disk vs the exact figure implied by L*H*dtype (+ ids, mask).

    .venv/bin/python scripts/bench_capture.py [--records 64] [--max-length 1024] [--repeats 2]

Both sides run in this process on the same prepared ShareGPT slice with the same
token-budget batches; the baseline is the target's body (embeddings, layers,
final norm; no hooks, no copies, no writes), the capture is `recipes/capture.py`'s
`run` end to end (hooks, bf16 cast, packing, safetensors writes, sha256). Goal:
ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from recipes import capture, prepare
from trainer.capture import right_pad, token_budget_batches
from trainer.config import CaptureConfig, PrepareConfig
from trainer.data.prepared import load_prepared
from trainer.target import DEFAULT_TARGET, load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--samples-per-shard", type=int, default=16)
    ap.add_argument("--max-tokens-per-batch", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare.run(PrepareConfig(output_dir=str(tmp / "prepared"), target=args.target, source="sharegpt",
                                  max_records=args.records, max_length=args.max_length))
        ds, _ = load_prepared(tmp / "prepared")
        target = load_target(args.target)
        ids_all = ds["input_ids"]
        S = args.samples_per_shard
        batches = []
        for k in range(0, len(ids_all), S):
            shard = ids_all[k:k + S]
            batches += [right_pad([shard[i] for i in b], 0)
                        for b in token_budget_batches([len(x) for x in shard], args.max_tokens_per_batch)]
        tokens = sum(len(x) for x in ids_all)
        padded = sum(b[0].numel() for b in batches)

        def bare() -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                for input_ids, mask in batches:
                    target.backbone(input_ids=input_ids, attention_mask=mask, use_cache=False)
            return time.perf_counter() - t0

        def captured(r: int) -> tuple[float, dict]:
            cfg = CaptureConfig(data=str(tmp / "prepared"), output_dir=str(tmp / f"capture{r}"), target=args.target,
                                samples_per_shard=S, max_tokens_per_batch=args.max_tokens_per_batch)
            t0 = time.perf_counter()
            manifest = capture.run(cfg)
            return time.perf_counter() - t0, manifest

        bare()  # warm-up: oneDNN primitives for these shapes
        base_s, cap_s, manifest = [], [], None
        for r in range(args.repeats):  # interleaved, best of each: the machine is shared
            base_s.append(bare())
            s, manifest = captured(r)
            cap_s.append(s)
        b, c = min(base_s), min(cap_s)
        bpt = manifest["bytes_per_token"]
        print(f"target {target.name}: {len(ds)} samples, {tokens:,} tokens, {len(batches)} batches "
              f"({padded / tokens:.2f}x padded), {torch.get_num_threads()} threads")
        print(f"bare target forward   {tokens / b:10,.0f} tokens/s  ({b:.2f} s)")
        print(f"capture (end to end)  {tokens / c:10,.0f} tokens/s  ({c:.2f} s)")
        print(f"ratio capture/bare time: {c / b:.3f}  (goal <= 1.10)")
        print(f"bytes/token on disk {bpt['on_disk']:.2f} vs expected {bpt['expected']:.2f} "
              f"(L={len(manifest['aux_layer_ids'])}, H={manifest['target']['hidden_size']}, "
              f"{manifest['store_dtype']}; ratio {bpt['on_disk'] / bpt['expected']:.4f})")


if __name__ == "__main__":
    main()
