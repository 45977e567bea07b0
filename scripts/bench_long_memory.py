"""Peak memory of one training step per sample length, for each algorithm, with and without
activation checkpointing (`gradient_checkpointing=true`): what long samples (issue 43: up to the
target's context, SmolLM2's 8,192) cost in training.

The draft is the SmolLM2 recipe's (recipes/configs/smollm2-135m/<algorithm>.yaml, its shape filled
from the real target's config), the target the real SmolLM2-135M-Instruct loaded head-only (its
embedding, final norm and LM head: what training reads of it), the states random (their values
do not change memory), one sample of T tokens, every token an assistant token. Each cell runs in
a fresh process and reports its peak RSS and the step's own share (peak minus what the process
held before the step); the loss is printed beside it (checkpointing changes memory, not the loss).

    .venv/bin/python scripts/bench_long_memory.py                                  # 1K..8K, every algorithm
    .venv/bin/python scripts/bench_long_memory.py --algorithms dflash --tokens 1024,2048 --checkpointing 0
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRAFT_VOCAB = 32000  # the capture's draft vocabulary at the library default (EAGLE-3's own head)


def one_step(algorithm: str, tokens: int, checkpointing: bool) -> dict:
    """One forward + backward of the algorithm's training step at T = `tokens`."""
    import dataclasses

    import torch
    import yaml

    from trainer.config.loader import load_section
    from trainer.data.vocab import build_draft_vocab
    from trainer.drafts.registry import build, get
    from trainer.target import load_target

    torch.manual_seed(0)
    algo = get(algorithm)
    target = load_target("smollm2-135m-instruct", head_only=True)
    recipe = yaml.safe_load((REPO / "recipes" / "configs" / "smollm2-135m" / f"{algorithm}.yaml").read_text())
    text = target.model.config.get_text_config()
    ids = algo.default_layer_ids(target.num_layers)
    cfg = load_section(algo.Config, dict(recipe.get("draft") or {}), "draft")
    cfg = dataclasses.replace(cfg).fill_from_target(text, ids, DRAFT_VOCAB)
    if getattr(cfg, "mask_token_id", 0) is None:
        cfg.mask_token_id = target.vocab_size - 1
    draft = build(algorithm, cfg, target).train()
    draft.set_vocab(*build_draft_vocab(torch.arange(target.vocab_size, 0, -1), cfg.draft_vocab_size or DRAFT_VOCAB))
    Vd = cfg.draft_vocab_size or target.vocab_size
    draft.gradient_checkpointing = checkpointing
    H = target.hidden_size
    x = torch.randint(0, Vd - 1, (1, tokens))
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "loss_mask": torch.ones_like(x),
             "aux_hidden_states": torch.randn(1, tokens, len(cfg.aux_layer_ids) * H),
             "last_hidden_state": torch.randn(1, tokens, H), "target_argmax": x.roll(-1, 1)}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    labels = algo.target_labels(target, batch, draft)
    m = algo.training_step(draft, batch, labels)
    m.loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"algorithm": algorithm, "tokens": tokens, "checkpointing": checkpointing, "loss": float(m.loss),
            "peak_rss_mib": peak / 1024, "step_rss_mib": (peak - before) / 1024, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="eagle3,dflash,dspark")
    ap.add_argument("--tokens", default="1024,2048,4096,8192", help="tokens per sample")
    ap.add_argument("--checkpointing", default="0,1", help="gradient_checkpointing off (0) and/or on (1)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        algorithm, tokens, ckpt = args.child.split(":")
        print(json.dumps(one_step(algorithm, int(tokens), ckpt == "1")))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONPATH": str(REPO)}
    print("one training step per cell (a fresh process each), SmolLM2-135M recipes, batch 1; peak RSS of the "
          "process (the step's own share)")
    print(f"{'algorithm':9s} {'tokens':>6s}  " + "  ".join(f"{'checkpointing ' + c:>28s}"
                                                            for c in ("off" if c == "0" else "on"
                                                                      for c in args.checkpointing.split(","))))
    for algorithm in args.algorithms.split(","):
        for tokens in args.tokens.split(","):
            cells = []
            for ckpt in args.checkpointing.split(","):
                r = subprocess.run([sys.executable, __file__, "--child", f"{algorithm}:{tokens}:{ckpt}"],
                                   capture_output=True, text=True, env=env)
                if r.returncode:  # killed by a signal (-9: the kernel's out-of-memory killer, as a rule) or an error
                    why = f"killed by signal {-r.returncode}" if r.returncode < 0 else \
                        (r.stderr.strip().splitlines() or ["?"])[-1][:60]
                    cells.append(f"{'failed: ' + why:>28s}")
                    continue
                res = json.loads(r.stdout.strip().splitlines()[-1])
                cells.append(f"{res['peak_rss_mib']:6.0f} MiB ({res['step_rss_mib']:5.0f}) {res['seconds']:5.1f} s "
                             f"{res['loss']:.3f}"[:28].rjust(28))
            print(f"{algorithm:9s} {int(tokens):6d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
