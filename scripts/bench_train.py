"""Benchmark: draft training throughput of the recipe's real step.

    .venv/bin/python scripts/bench_train.py --capture runs/cmp/capture [--steps 24] [--algorithm eagle3]
    .venv/bin/python scripts/bench_train.py --capture runs/cmp/capture --vary draft.train_lm_head=true,false
    .venv/bin/python scripts/bench_train.py --capture runs/bench/capture --peer speculators
    .venv/bin/python scripts/bench_train.py --shape 8b            (needs a GPU: an 8B-shaped draft)

1. SmolLM2 (CPU): `recipes/train.py` itself, in a subprocess per run (the real loop: labels,
   forward, backward, clipping, optimizer and scheduler steps under accelerate), on the same
   capture samples in the same order; `--vary KEY=A,B` alternates runs of the variants
   (A, B, A, B, ...). Tokens counted: the non-padding tokens of the samples trained on
   (train_report.json `tokens`) over the loop's wall time (`seconds`, the first step's
   warm-up included); peak RSS: the training process's own (`peak_rss_mib`). Prints each
   run, the median per variant and the ratio to the first variant, measured in this run.
2. `--peer speculators`: side by side with vLLM's speculators 0.9.0 EAGLE-3 trainer
   (scripts/setup_speculators.sh installs it into .speculators-venv; never a draftsmith
   dependency). Both train one epoch, batch 1, AdamW, fp32, on every sample of the capture
   (cut to --max-length), the same features (EAGLE-3's aux layers + the last pre-norm state),
   the same draft vocabulary (the capture's d2t/t2d) and the same draft shape (1 layer, the
   target's, `--ttt-steps`). The capture is exported once to speculators' own format (arrow
   dataset + hidden_states/hs_<i>.safetensors); the peer runs its own CLI entry point in
   scripts/peer_speculators.py (what is changed around it to run on a CPU is stated there).
   Runs alternate (draftsmith, speculators, ...); tokens = the tokens of the samples trained on,
   over each trainer's epoch wall time; prints each run, the medians, the ratio and peak RSS.
3. 8B-shaped draft (H=4096, I=14336, 32/8 heads, Vd=32000, T=2048, K=7) on random
   features: achieved TFLOP/s and MFU against the device's peak (goal on an H200: >= 40%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainer.drafts.registry import get

eagle3 = get("eagle3")  # the draft contract (trainer/drafts/__init__.py)
REPO = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO / ".speculators-venv" / "bin" / "python"  # scripts/setup_speculators.sh

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


def timed_run(cmd: list[str], threads: int, report: Path, what: str) -> dict:
    """One trainer run in its own process, `threads` intra-op threads -> its JSON report."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{what} failed:\n{r.stderr[-3000:]}")
    return json.loads(report.read_text())


def recipe_run(capture: str, algorithm: str, steps: int, threads: int, overrides: list[str]) -> dict:
    """One `recipes/train.py` run -> its train_report.json."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        out = Path(tmp) / "draft"
        cmd = [sys.executable, str(REPO / "recipes" / "train.py"), "--config",
               str(REPO / "recipes" / "configs" / "smollm2-135m" / f"{algorithm}.yaml"), f"data={capture}",
               f"output_dir={out}", f"max_steps={steps}", "epochs=1000", "batch_size=1",
               "gradient_accumulation_steps=1", f"log_every={steps}", "save_every=1000000", *overrides]
        return timed_run(cmd, threads, out / "train_report.json", f"recipes/train.py ({' '.join(overrides)})")


def bench_recipe(capture: str, algorithm: str, steps: int, repeats: int, vary: str | None, threads: int) -> None:
    variants = [[]]
    if vary:
        key, values = vary.split("=", 1)
        variants = [[f"{key}={v}"] for v in values.split(",")]
    runs = {tuple(v): [] for v in variants}
    for _ in range(repeats):  # alternating: the machine's drift hits every variant alike
        for v in variants:
            r = recipe_run(capture, algorithm, steps, threads, v)
            runs[tuple(v)].append(r)
            f = r["final"]
            print(f"  {' '.join(v) or 'default':<32} {r['tokens'] / r['seconds']:8.0f} tokens/s  "
                  f"peak RSS {r['peak_rss_mib']:7.0f} MiB  loss {f.get('loss', float('nan')):.4f}  "
                  f"simulated τ {f.get('tau', float('nan')):.3f}", flush=True)
    print(f"\n{algorithm} via recipes/train.py on {capture}: {steps} steps x batch 1 per run, {threads} threads, "
          f"{repeats} alternating runs per variant; tokens = non-padding tokens trained on")
    base = None
    for v, rs in runs.items():
        tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        rss = max(r["peak_rss_mib"] for r in rs)
        base = base or tps
        print(f"  {' '.join(v) or 'default':<32} median {tps:8.0f} tokens/s ({tps / base:.2f}x the first)  "
              f"peak RSS {rss:7.0f} MiB")


def export_for_peer(capture: str, out: Path, max_length: int, limit: int | None = None) -> tuple[list[int], dict]:
    """The capture's samples (cut to max_length; the first `limit` only, if given) in speculators'
    offline format -> (EAGLE-3 ids, info). One extra sample (a copy of the first) is its
    validation split, which it insists on (not timed)."""
    import numpy as np
    from datasets import Dataset
    from safetensors.torch import load_file, save_file

    from trainer.data.collate import dequantize_states
    from trainer.data.shards import DRAFT_VOCAB, CaptureReader, verify_capture

    info = verify_capture(capture)
    m = info.manifest
    ids = m["draft_layer_ids"]["eagle3"]
    H = m["target"]["hidden_size"]
    reader = CaptureReader(capture, ids)
    (out / "hidden_states").mkdir(parents=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    n = min(len(reader), limit or len(reader))
    for i in [*range(n), 0]:
        s = dequantize_states(reader[i])  # a float8 capture's states in bfloat16, as training sees them
        T = min(s["input_ids"].numel(), max_length)
        aux, last = s["aux_hidden_states"][:T].view(T, len(ids), H), s["last_hidden_state"][:T].view(T, 1, H)
        states = torch.cat([aux, last], 1)
        save_file({"hidden_states": states.contiguous(), "token_ids": s["input_ids"][:T].long()},
                  out / "hidden_states" / f"hs_{len(rows['seq_len'])}.safetensors")
        rows["input_ids"].append(s["input_ids"][:T].long().tolist())
        rows["loss_mask"].append(s["loss_mask"][:T].long().tolist())
        rows["seq_len"].append(T)
    ds = Dataset.from_dict(rows)
    ds.set_format("torch")
    ds.save_to_disk(str(out))
    vocab = load_file(info.path / DRAFT_VOCAB)
    np.save(out / "d2t.npy", vocab["d2t"].numpy())
    np.save(out / "t2d.npy", vocab["t2d"].numpy())
    desc = {"train_samples": n, "train_tokens": sum(rows["seq_len"][:n]), "draft_vocab_size": int(vocab["d2t"].numel()),
            "train_data_ratio": (n + 0.5) / (n + 1)}  # speculators' split: int(ratio * (n + 1)) = n train rows
    (out / "bench_samples.json").write_text(json.dumps(desc))
    return ids, desc


def peer_run(data: Path, verifier: str, ids: list[int], ttt_steps: int, lr: float, max_length: int,
             threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        cmd = [str(PEER_PYTHON), str(REPO / "scripts" / "peer_speculators.py"), "--data", str(data), "--verifier",
               verifier, "--out", tmp, "--aux-layer-ids", ",".join(map(str, ids)), "--ttt-steps", str(ttt_steps),
               "--lr", str(lr), "--max-length", str(max_length)]
        return timed_run(cmd, threads, Path(tmp) / "peer_report.json", "speculators")


def bench_peer(capture: str, repeats: int, threads: int, ttt_steps: int, max_length: int) -> None:
    from trainer.config import TrainConfig, load_config
    from trainer.target import resolve_target, target_hf_dir

    if not PEER_PYTHON.exists():
        raise SystemExit("no .speculators-venv: run `bash scripts/setup_speculators.sh` first")
    cfg = load_config(TrainConfig, REPO / "recipes" / "configs" / "smollm2-135m" / "eagle3.yaml", [f"data={capture}"])
    verifier = str(target_hf_dir(resolve_target(cfg.target)))  # the target as a Hugging Face folder
    with tempfile.TemporaryDirectory(prefix="bench-peer-data-") as tmp:
        ids, desc = export_for_peer(capture, Path(tmp) / "data", max_length)
        n = desc["train_samples"]
        ours = [f"draft.ttt_steps={ttt_steps}", f"max_length={max_length}", "draft.train_lm_head=false"]
        runs = {"draftsmith": [], "speculators": []}
        for _ in range(repeats):  # alternating: the machine's drift hits both alike
            r = recipe_run(capture, "eagle3", n, threads, ours)
            runs["draftsmith"].append(r)
            p = peer_run(Path(tmp) / "data", verifier, ids, ttt_steps, cfg.learning_rate, max_length, threads)
            runs["speculators"].append(p)
            for name, x in (("draftsmith", r), ("speculators", p)):
                print(f"  {name:<12} {int(x['tokens']):7d} tokens in {x['seconds']:6.1f} s = "
                      f"{x['tokens'] / x['seconds']:7.0f} "
                      f"tokens/s  peak RSS {x['peak_rss_mib']:6.0f} MiB", flush=True)
    print(f"\nEAGLE-3 (1 layer, TTT {ttt_steps}, Vd {desc['draft_vocab_size']}, AdamW, fp32, {threads} threads) "
          f"on {capture}: "
          f"{n} samples ({desc['train_tokens']} tokens, cut to {max_length}), one epoch, batch 1, "
          f"{repeats} alternating runs each; "
          "tokens = the tokens of the samples trained on")
    med = {k: statistics.median(x["tokens"] / x["seconds"] for x in v) for k, v in runs.items()}
    rss = {k: max(x["peak_rss_mib"] for x in v) for k, v in runs.items()}
    for k in runs:
        print(f"  {k:<12} median {med[k]:7.0f} tokens/s  peak RSS {rss[k]:6.0f} MiB")
    print(f"  draftsmith/speculators: {med['draftsmith'] / med['speculators']:.2f}x tokens/s, "
          f"{rss['draftsmith'] / rss['speculators']:.2f}x peak RSS")


def bench_8b(steps: int, K: int, T: int) -> None:
    if not torch.cuda.is_available():
        print("8B-shaped draft: skipped (no GPU; run on a ROCm/CUDA device)")
        return
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    cfg = eagle3.Config(ttt_steps=K, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8,
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
    ap.add_argument("--algorithm", default="eagle3", help="eagle3, dflash or dspark (recipes/configs/smollm2-135m/)")
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps per recipe run (8B shape: timed steps)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per variant")
    ap.add_argument("--vary", help="KEY=A,B: one recipe override, its variants compared (e.g. draft.ttt_steps=3,7)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer", choices=["speculators"], help="side by side with the peer trainer (EAGLE-3)")
    ap.add_argument("--max-length", type=int, default=768, help="--peer: samples cut to this many tokens")
    ap.add_argument("--ttt-steps", type=int, help="TTT steps: 3 with --peer (as compared), 7 for the 8B shape")
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    if args.peer:
        bench_peer(args.capture, args.repeats, args.threads, args.ttt_steps or 3, args.max_length)
        return
    if args.shape in ("smollm2", "all"):
        bench_recipe(args.capture, args.algorithm, args.steps, args.repeats, args.vary, args.threads)
    if args.shape in ("8b", "all"):
        bench_8b(args.steps, args.ttt_steps or 7, args.seq_len)


if __name__ == "__main__":
    main()
