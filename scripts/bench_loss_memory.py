"""Peak memory of one DFlash (or DSpark) training step, chunked loss vs unchunked, at a
scaled-down shape with a full-size vocabulary (Qwen3's 151,936 tokens: the logits are what
grows). Each variant runs in a fresh process and reports its peak RSS; the step's loss is
printed beside it (chunking changes memory, not the loss).

    .venv/bin/python scripts/bench_loss_memory.py                       # DFlash, H 512, 64 anchors x 15 slots
    .venv/bin/python scripts/bench_loss_memory.py --algorithm dspark --chunks 0,256

At the Qwen3-8B recipe (512 anchors x 15 slots, V 151,936) the unchunked fp32 logits alone are
4.7 GB per sample; loss_chunk_rows (default 1024) bounds them to 1024 rows at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_step(algorithm: str, chunk: int, hidden: int, vocab: int, tokens: int, anchors: int, block: int) -> dict:
    """One forward + backward of the algorithm's training step on random weights and data."""
    import torch
    from torch import nn

    from trainer.drafts.registry import get

    torch.manual_seed(0)
    algo = get(algorithm)
    heads = max(hidden // 64, 1)
    cfg = algo.Config(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                      num_key_value_heads=max(heads // 4, 1), head_dim=64, rms_norm_eps=1e-6,
                      max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      target_hidden_size=hidden, vocab_size=vocab, aux_layer_ids=[1, 2, 3], num_hidden_layers=1,
                      block_size=block, num_anchors=anchors, mask_token_id=vocab - 1, loss_chunk_rows=chunk,
                      **({"markov_rank": 64} if algorithm == "dspark" else {}))
    embed, head = nn.Embedding(vocab, hidden).requires_grad_(False), nn.Linear(hidden, vocab, bias=False)
    head.requires_grad_(False)
    draft = algo.Draft(cfg, embed, head).train()
    ids = torch.randint(0, vocab - 1, (1, tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "aux_hidden_states": torch.randn(1, tokens, 3 * hidden), "target_argmax": ids.roll(-1, 1),
             "last_hidden_state": torch.randn(1, tokens, hidden)}

    class Target:  # what target_labels reads of a target: its final norm and LM head
        model = type("M", (), {"lm_head": head})()
        backbone = type("B", (), {"norm": nn.Identity()})()
        dtype = torch.float32

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    labels = algo.target_labels(Target, batch, draft)
    m = algo.training_step(draft, batch, labels)
    m.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = int(labels["valid"].sum()) * cfg.num_positions  # supervised slots (every token is an assistant token)
    return {"chunk": chunk, "loss": float(m.loss), "rows": rows, "peak_rss_mib": peak / 1024,
            "step_rss_mib": (peak - before) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", default="dflash", choices=["dflash", "dspark"])
    ap.add_argument("--chunks", default="0,128", help="loss_chunk_rows values; 0 = one pass")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = dict(hidden=args.hidden, vocab=args.vocab, tokens=args.tokens, anchors=args.anchors, block=args.block)
    if args.child is not None:
        print(json.dumps(one_step(args.algorithm, args.child, **shape)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONPATH": str(REPO)}
    print(f"{args.algorithm} training step, H {args.hidden}, V {args.vocab:,}, {args.anchors} anchors x block "
          f"{args.block}, one process per variant")
    results = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        r = subprocess.run([sys.executable, __file__, "--algorithm", args.algorithm, "--child", str(chunk),
                            *(f"--{k}={v}" for k, v in shape.items())], capture_output=True, text=True, env=env,
                           check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        results.append(res)
        name = "one pass" if chunk == 0 else f"chunks of {chunk}"
        print(f"  {name:16s} {res['rows']:5d} supervised rows  loss {res['loss']:.6f}  peak RSS "
              f"{res['peak_rss_mib']:7.0f} MiB (the step: {res['step_rss_mib']:6.0f} MiB)")
    base = results[0]["step_rss_mib"]
    for res in results[1:]:
        print(f"chunk {res['chunk']} / one pass: step memory x{res['step_rss_mib'] / base:.2f}, "
              f"loss {res['loss'] - results[0]['loss']:+.2e}")


if __name__ == "__main__":
    main()
