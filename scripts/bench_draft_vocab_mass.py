"""Benchmark: how much of the target's next-token distribution falls inside a capture's draft
vocabulary, at the positions training reads (the next token is an answer token). The training
step's p is the target's distribution renormalized over the draft vocabulary, so the acceptance
α it reports reads high by at most 1 − this mass (docs/train.md).

    .venv/bin/python scripts/bench_draft_vocab_mass.py --capture runs/objectives-100k/capture [--positions 4000]

Reads the capture's first shard: its pre-norm last states through the target's final norm and
full LM head (the family's logit transform as its forward applies it), softmaxed in float32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from trainer.data.shards import load_manifest
from trainer.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", required=True)
    ap.add_argument("--positions", type=int, default=4000, help="first positions of the first shard read")
    args = ap.parse_args()
    cap = Path(args.capture)
    manifest = load_manifest(cap).manifest
    target = load_target(manifest["target"]["path"])
    with safe_open(cap / manifest["shards"][0]["file"], "pt") as f:
        last = f.get_tensor("last_hidden_state")[:args.positions]
        mask = f.get_tensor("loss_mask")[:args.positions]
    with safe_open(cap / manifest["draft_vocab"]["file"], "pt") as f:
        in_vocab = f.get_tensor("t2d").bool()  # [V]
    rows = last[:-1][mask[1:].bool()]  # the next token is an answer token
    with torch.no_grad():
        p = torch.cat([target.head_logits(target.final_norm(h.to(target.dtype))).float().softmax(-1)
                       for h in rows.split(512)])
    mass = p[:, in_vocab].sum(-1)
    print(json.dumps({"capture": str(cap), "draft_vocab": int(in_vocab.sum()), "vocab": int(in_vocab.numel()),
                      "positions": int(mass.numel()), "mean_mass": round(mass.mean().item(), 4),
                      "p10": round(mass.quantile(0.1).item(), 4), "min": round(mass.min().item(), 4)}))


if __name__ == "__main__":
    main()
