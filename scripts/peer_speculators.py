"""The peer trainer for `scripts/bench_train.py --peer speculators`: vLLM's speculators 0.9.0
EAGLE-3 trainer, through its own entry point (`speculators.train.cli.main` on a
`TrainConfig` resolved from command-line flags), on samples that bench_train.py exported
from a draftsmith capture. Runs in .speculators-venv (scripts/setup_speculators.sh); never
imported by draftsmith.

    .speculators-venv/bin/python scripts/peer_speculators.py --data DIR --verifier DIR --out DIR \
        --aux-layer-ids 2,15,27 --ttt-steps 3 --lr 5e-4 --max-length 768

What is changed around the trainer, never inside its step (forward, loss, backward,
clipping, optimizer, scheduler), so that it runs on a CPU and only training is timed:
- the device: speculators 0.9 moves the model and every batch to `get_local_rank()`, a CUDA
  index; here it is "cpu" (its autocast then targets "cuda" and is a no-op: fp32, like ours),
  and `torch.accelerator.synchronize` (its step timer's, on logged steps) is a no-op;
- its loss: `--loss-implementation eager` (its default, a fused Triton kernel, needs a GPU);
- its validation epoch and checkpoint writes are skipped (draftsmith's timed loop does neither;
  --keep-checkpoint keeps its checkpoint, written after the timed epoch, for scripts/bench_quality.py);
- `Trainer.train_epoch` is timed: the wall time of the epoch's loop, the first step's warm-up
  included (as draftsmith's `seconds`).
Writes OUT/peer_report.json: tokens (the tokens of the samples trained on, counted as draftsmith
counts its own), seconds, steps, peak_rss_mib (this process).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="speculators data dir (arrow dataset + hidden_states/)")
    ap.add_argument("--verifier", required=True, help="the target as a Hugging Face folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--aux-layer-ids", required=True, help="comma-separated, vLLM's convention")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max-length", type=int, default=768, help="speculators' total_seq_len (packing budget)")
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--num-workers", type=int, default=0, help="speculators' dataloader workers")
    ap.add_argument("--loss-fn", default=None, help="speculators' --loss-fn (kl_div, rkl, jsd, tv, lk_hybrid, a JSON "
                    "mix); default: its own (kl_div for EAGLE-3)")
    ap.add_argument("--own-defaults", action="store_true",
                    help="its own optimizer, learning rate, weight decay and schedule (Muon, 1e-3, 0.01, linear) "
                         "instead of AdamW at --lr, no weight decay, cosine (draftsmith's recipe)")
    ap.add_argument("--keep-checkpoint", action="store_true",
                    help="save the trained draft as speculators saves it (OUT/checkpoints/0; after the timed epoch)")
    args = ap.parse_args()

    import torch
    from speculators.train import cli, trainer
    from speculators.train.config import TrainConfig

    data = Path(args.data)
    info = json.loads((data / "bench_samples.json").read_text())
    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
    timed = {}
    train_epoch = trainer.Trainer.train_epoch

    def timed_epoch(self, epoch, **kw):
        t0 = time.perf_counter()
        train_epoch(self, epoch, **kw)
        timed["seconds"] = time.perf_counter() - t0
        timed["steps"] = self.global_step

    trainer.Trainer.train_epoch = timed_epoch
    trainer.Trainer.val_epoch = lambda self, epoch: None
    if not args.keep_checkpoint:
        trainer.Trainer.maybe_save_checkpoint = lambda self, *a, **k: None

    out = Path(args.out)
    flags = ["--verifier-name-or-path", args.verifier, "--data-path", str(data), "--speculator-type", "eagle3",
             "--num-layers", str(args.num_layers), "--draft-arch", "llama",
             "--target-layer-ids", *args.aux_layer_ids.split(","),
             "--draft-vocab-size", str(info["draft_vocab_size"]),
             "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
             "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--total-seq-len", str(args.max_length),
             "--train-data-ratio", str(info["train_data_ratio"]), "--hidden-states-dtype", "float32",
             "--num-workers", str(args.num_workers), "--on-missing", "raise",
             "--ttt-steps", str(args.ttt_steps), "--epochs", "1",
             "--log-freq", "1000000", "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
             "--no-resume-from-checkpoint"]
    if not args.own_defaults:
        flags += ["--optimizer", "adamw", "--lr", str(args.lr), "--weight-decay", "0.0", "--scheduler-type", "cosine"]
    if args.loss_fn:
        flags += ["--loss-fn", args.loss_fn]
    torch.manual_seed(0)
    cli.main(TrainConfig.resolve(flags))
    if "seconds" not in timed:
        sys.exit("peer_speculators: speculators trained no epoch")
    report = {"tokens": info["train_tokens"], "seconds": timed["seconds"],
              "steps": timed["steps"], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "threads": torch.get_num_threads()}
    (out / "peer_report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
