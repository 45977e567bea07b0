"""Benchmark: EAGLE-3 training throughput.

    .venv/bin/python scripts/bench_train.py --capture runs/demo/capture [--steps 6]
    .venv/bin/python scripts/bench_train.py --shape 8b            (needs a GPU: an 8B-shaped draft)

1. SmolLM2 (CPU): training tokens/s and peak memory of the real training step on a
   capture, against the forward+backward of the draft's dense layers alone on the
   same tokens (the floor the TTT unroll adds attention and bookkeeping to).
2. 8B-shaped draft (H=4096, I=14336, 32/8 heads, Vd=32000, T=2048, K=7) on random
   features: achieved TFLOP/s and MFU against the device's peak (goal on an H200: >= 40%).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from trainer.drafts import get

eagle3 = get("eagle3")  # the draft contract (trainer/drafts/__init__.py)

# Dense bf16 peak TFLOP/s by device name (vendor datasheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "MI300X": 1307.0, "MI325X": 1307.0, "MI355X": 2300.0, "A100": 312.0}


def draft_flops_per_token(cfg, T: int, K: int) -> float:
    """fwd+bwd FLOPs per token for K TTT steps (matmuls: 2 per MAC, x3 for backward)."""
    H, inter, hd, nh, nkv, Vd = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.draft_vocab_size)
    fc = 3 * cfg.target_hidden_size * H
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * inter
    head = H * Vd
    attn = [nh * hd * 2 * (T / 2 if k == 0 else T + k) for k in range(K)]  # QK^T and PV per query
    return 6.0 * (fc + K * (layer + head) + sum(attn))


def run_steps(draft, batch, labels, steps, optimizer) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        m = eagle3.training_step(draft, batch, labels)
        m.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_smollm2(capture: str, steps: int, K: int) -> None:
    from recipes.train import load_data
    from trainer.config import TrainConfig
    from trainer.data.collate import collate
    from trainer.target import load_target

    target = load_target("smollm2-135m-instruct")
    cfg = TrainConfig(data=capture, output_dir="-", max_length=1024)
    ds, ids, d2t, t2d, _, _ = load_data(cfg, target)
    dcfg = eagle3.Config(ttt_steps=K).fill_from_target(target.model.config, ids, int(d2t.numel()))
    draft = eagle3.Draft(dcfg, target.backbone.embed_tokens)
    draft.set_vocab(d2t, t2d)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    batches = [collate([ds[i]]) for i in range(min(steps, len(ds)))]
    labels = [eagle3.target_labels(target, b, draft) for b in batches]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    run_steps(draft, batches[0], labels[0], 1, opt)  # warm-up
    t0 = time.perf_counter()
    for b, p in zip(batches, labels):
        run_steps(draft, b, p, 1, opt)
    train_s = time.perf_counter() - t0
    # Baseline: the same dense layers fwd+bwd once per TTT step, without the unroll's attention.
    t0 = time.perf_counter()
    for b in batches:
        x = draft.fc(b["aux_hidden_states"])
        loss = 0
        for _ in range(K):
            h = torch.cat([x, x], -1)
            a = draft.midlayer.self_attn.o_proj(draft.midlayer.self_attn.q_proj(h))
            loss = loss + draft.lm_head(draft.midlayer.mlp(a)).float().logsumexp(-1).mean()
        loss.backward()
        opt.zero_grad()
    dense_s = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"SmolLM2 EAGLE-3 (H={dcfg.hidden_size}, Vd={dcfg.draft_vocab_size}, K={K}), {len(batches)} samples, "
          f"{tokens:,} tokens, {torch.get_num_threads()} threads")
    print(f"  training step      {tokens / train_s:8.0f} tokens/s")
    print(f"  dense layers only  {tokens / dense_s:8.0f} tokens/s   ratio train/dense time {train_s / dense_s:.2f}")
    print(f"  peak RSS {peak_mb:,.0f} MiB")


def bench_8b(steps: int, K: int, T: int) -> None:
    if not torch.cuda.is_available():
        print("8B-shaped draft: skipped (no GPU; run on a ROCm/CUDA device)")
        return
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    cfg = eagle3.Config(ttt_steps=K, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, target_hidden_size=4096,
                       vocab_size=128256, draft_vocab_size=32000, aux_layer_ids=[2, 16, 29])
    embed = torch.nn.Embedding(cfg.vocab_size, 4096).to(dev, torch.bfloat16).requires_grad_(False)
    draft = eagle3.Draft(cfg, embed).to(dev)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, fused=True)
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (1, T), device=dev),
             "loss_mask": torch.ones(1, T, dtype=torch.long, device=dev),
             "attention_mask": torch.ones(1, T, dtype=torch.long, device=dev),
             "aux_hidden_states": torch.randn(1, T, 3 * 4096, device=dev)}
    labels = {"p": torch.randn(1, T, 32000, device=dev).softmax(-1),
              "in_vocab": torch.ones(1, T, dtype=torch.bool, device=dev)}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        run_steps(draft, batch, labels, 2, opt)  # warm-up
        torch.cuda.reset_peak_memory_stats()
        s = run_steps(draft, batch, labels, steps, opt)
    tflops = draft_flops_per_token(cfg, T, K) * T * steps / s / 1e12
    print(f"8B-shaped EAGLE-3 draft on {name}: T={T}, K={K}: {T * steps / s:,.0f} tokens/s, {tflops:.1f} TFLOP/s"
          + (f", MFU {100 * tflops / peak:.1f}% of {peak:.0f} (goal >= 40%)" if peak else "")
          + f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", default="runs/demo/capture")
    ap.add_argument("--shape", choices=["smollm2", "8b", "all"], default="all")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    if args.shape in ("smollm2", "all"):
        bench_smollm2(args.capture, args.steps, args.ttt_steps)
    if args.shape in ("8b", "all"):
        bench_8b(args.steps, args.ttt_steps, args.seq_len)


if __name__ == "__main__":
    main()
