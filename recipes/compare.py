"""Which draft to serve, at which N, at which load: every export given, vLLM's n-gram and no
speculation, measured on the user's prompts on this machine; for each concurrency the
configuration with the most expected output tokens/s, and the --speculative-config that serves it.

    draftsmith compare --drafts runs/demo/export-bf16 runs/demo/export-fp8 --dataset gsm8k --concurrency 1,4,16
    draftsmith compare --drafts runs/demo/export-bf16 --check-vllm      (serve the best two at each load in vLLM)

What is measured, and how the prediction is made from it:
- acceptance: each candidate decoded by the in-tree decoder (which counts what vLLM counts:
  tests/test_vllm.py) on the prompts, one at a time, greedy, at every N from 1 to the positions
  it was trained on, each N measured (a block draft's proposals change with N); the n-gram up to
  the largest N of the drafts'. Per candidate and N: τ, the share of decoding steps with a
  proposal (below 1 only for the n-gram, which proposes nothing without a match), and so the
  tokens per decoding step, 1 + share x (τ - 1).
- costs, on this machine, in-tree (vLLM's own step times are not measured yet): the target's
  forward over b rows of width w (w = 1: plain decoding; N + 1: a verify) after a context of the
  prompts' mean length plus half an answer, and each candidate's draft time per round (propose
  and commit) over b rows at each N, from a short batched decode.
- expected tokens/s (Leviathan et al., 2023, §3.4, the costs measured, not assumed):
  b x tokens per step / (share x (V(b, N+1) + D(b, N)) + (1 - share) x V(b, 1)); no speculation:
  b / V(b, 1). For each concurrency the best (candidate, N) and the runner-up.
Writes OUTPUT_DIR/report.json, compare.png (tokens/s against concurrency, one line per candidate
at its best N) and serve-c{b}.json (the --speculative-config for each concurrency, or null: serve
without speculation).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

from recipes._common import load_proposer, one_line_errors, parse_flags, prompt_ids, target_for
from trainer.config import CompareConfig, to_yaml
from trainer.data.chat import read_template, template_file
from trainer.data.evalsets import dataset_file, load_prompts
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json, ensure_dir, guard_output, write_run_files
from trainer.speculative import DecodeStats, NGramDraft, TargetSession, generate
from trainer.target import load_target, resolve_target
from trainer.vllm import checks

FLAGS = {"--dataset": ("dataset", "gsm8k, math500, humaneval, mtbench, sharegpt or jsonl:PATH"),
         "--num-prompts": ("num_prompts", "prompts decoded per candidate and N"),
         "--max-new-tokens": ("max_new_tokens", "tokens generated per prompt"),
         "--concurrency": ("concurrency", "requests in flight to recommend for, e.g. 1,4,16"),
         "--output-dir": ("output_dir", "where report.json, compare.png and serve-c*.json go"),
         "--chat-template": ("chat_template", "a Jinja chat template file for the prompts (default: the one the "
                                              "first draft's data was prepared with, else the target's)")}
SWITCHES = {"--check-vllm": ("check_vllm=true", "serve the best and the runner-up at each concurrency in vLLM and "
                                                "print their measured tokens/s beside the prediction"),
            "--no-ngram": ("ngram=false", "leave vLLM's n-gram out of the candidates")}
REPEATED = {"--drafts": ("drafts", "EXPORT", "export folders (draftsmith export), all for one target: "
                                             "--drafts A B or --drafts A --drafts B")}


def run(cfg: CompareConfig, argv=None) -> dict:
    # resolve: the target the first draft records (every other must record the same, checked at load)
    source = resolve_target(target_for(cfg.drafts[0] if cfg.drafts else "ngram", None))
    # check, before any measurement: the exports, a given template, the report folder
    read_template(cfg.chat_template, "compare --chat-template")
    for d in cfg.drafts:
        if not (Path(d) / "draftsmith_export.json").is_file():
            raise DraftsmithError(f"--drafts '{d}' is not an export (no draftsmith_export.json): compare measures "
                                  "what vLLM serves; export a trained draft first (draftsmith export)")
    guard_output(cfg.output_dir, [*cfg.drafts, dataset_file(cfg.dataset), template_file(cfg.chat_template),
                                  source.path], "compare", overwrite=cfg.overwrite)
    out = Path(cfg.output_dir)
    # produce: the candidates, their acceptance at every N, the costs, the model, the recommendation
    target = load_target(source)
    candidates = make_candidates(cfg, target)
    prompts = prompt_ids(target, load_prompts(cfg.dataset, cfg.num_prompts), cfg.drafts[0] if cfg.drafts else
                         "ngram", cfg.chat_template, False, "compare --chat-template")
    context = context_for(prompts, cfg.max_new_tokens)
    widths = sorted({1} | {n + 1 for c in candidates for n in c["ns"]})
    print(f"compare: {len(candidates)} candidates on {len(prompts)} prompts of {cfg.dataset}, concurrency "
          f"{cfg.concurrency}", file=sys.stderr)
    verify_s = {b: wider_costs_more({w: target_step_seconds(target, context, b, w) for w in widths})
                for b in cfg.concurrency}
    for c in candidates:
        c["by_n"] = {}
        for n in c["ns"]:
            print(f"compare: {c['name']} at N={n}", file=sys.stderr)
            c["by_n"][n] = {"acceptance": acceptance(target, c["proposer"], prompts, cfg.max_new_tokens, n),
                            "draft_s": {b: draft_round_seconds(target, c["proposer"], prompts, n, b, cfg.cost_steps)
                                        for b in cfg.concurrency}}
    predictions = predict(candidates, verify_s, cfg.concurrency)
    recommendations = recommend(predictions, candidates, cfg.concurrency)
    report = {"target": target.name, "target_sha256": target.content_hash, "dataset": cfg.dataset,
              "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "concurrency": cfg.concurrency,
              "costs_measured_in": "the in-tree decoder on this machine (vLLM's step times are not measured yet)",
              "machine": machine(), "verify_s": verify_s,
              "candidates": [{k: v for k, v in c.items() if k != "proposer"} for c in candidates],
              "predictions": predictions, "recommendations": recommendations}
    if cfg.check_vllm:
        report["vllm_check"] = check_in_vllm(target, candidates, recommendations, prompts, cfg, out)
    # publish: the report, the plot, a serving config per concurrency, the run files
    ensure_dir(out, "output_dir")
    atomic_write_json(out / "report.json", report)
    for b, r in recommendations.items():
        atomic_write_json(out / f"serve-c{b}.json", {"concurrency": b, "speculative_config": r["best"]["config"]})
    plot(report, out / "compare.png")
    write_run_files(out, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash},
                    argv, stage="compare")
    return report


def make_candidates(cfg: CompareConfig, target) -> list[dict]:
    """No speculation, each export (loaded against the target: an export for another is refused
    in one line), vLLM's n-gram; each with the Ns it is measured at."""
    out, largest = [], 1
    for d in cfg.drafts:
        manifest = json.loads((Path(d) / "draftsmith_export.json").read_text())
        proposer, name = load_proposer(d, target)
        most = proposer.num_positions if proposer.max_draft_tokens is None else \
            min(proposer.num_positions, proposer.max_draft_tokens)
        largest = max(largest, most)
        precision = f"FP8 {manifest['quantization']['scheme']}" if manifest.get("quantization") else manifest["dtype"]
        out.append({"name": f"{manifest['algorithm']} {precision} ({d})", "export": str(d),
                    "method": manifest["method"], "precision": precision, "ns": list(range(1, most + 1)),
                    "config": {"method": manifest["method"], "model": str(Path(d).resolve())}, "proposer": proposer})
    if cfg.ngram:
        ngram = NGramDraft(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        out.append({"name": f"ngram (n {ngram.min_n}..{ngram.max_n})", "export": None, "method": "ngram",
                    "precision": None, "ns": list(range(1, max(largest, 4) + 1)),
                    "config": ngram.speculative_config(), "proposer": ngram})
    return out


def context_for(prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """A context of the prompts' mean length plus half an answer: where a typical decoding step
    stands (its tokens: the prompts', repeated)."""
    length = int(statistics.mean(len(p) for p in prompts)) + max_new_tokens // 2
    tokens = [t for p in prompts for t in p]
    return (tokens * (length // len(tokens) + 1))[:length]


@torch.no_grad()
def target_step_seconds(target, context: list[int], b: int, w: int, repeats: int = 3) -> float:
    """The target's forward over b rows of w new tokens after `context` (median of `repeats`,
    each rolled back): plain decoding at w = 1, a verify of N draft tokens at w = N + 1."""
    session = TargetSession(target)
    session.prefill([context] * b)
    x = torch.full((b, w), context[-1], dtype=torch.long, device=target.device)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        t0 = time.perf_counter()
        session.verify(x)
        times.append(time.perf_counter() - t0)
        session.commit(torch.zeros(b, w, dtype=torch.bool, device=target.device))
    return statistics.median(times[1:])


def wider_costs_more(seconds: dict[int, float]) -> dict[int, float]:
    """A forward over more tokens never costs less than one over fewer (the same rows, the same
    context): timing noise below that is taken out (a running maximum over the widths), so that a
    draft that accepts nothing can never look faster than no speculation."""
    out, most = {}, 0.0
    for w in sorted(seconds):
        most = max(most, seconds[w])
        out[w] = most
    return out


def acceptance(target, proposer, prompts, max_new_tokens: int, n: int) -> dict:
    """One candidate at N, decoded one prompt at a time (as `draftsmith eval` and vLLM count)."""
    stats = DecodeStats(n)
    for prompt in prompts:
        _, s = generate(target, [prompt], max_new_tokens, proposer, n, eos_token_ids=target.eos_token_ids)
        stats.merge(s)
    share = stats.rounds / stats.iterations if stats.iterations else 0.0
    return {"tau": stats.tau, "share": share, "tokens_per_step": 1.0 + share * (stats.tau - 1.0) if stats.rounds
            else 1.0, **stats.counts(), "steps": stats.iterations}


def draft_round_seconds(target, proposer, prompts, n: int, b: int, steps: int) -> float:
    """The draft's time per round (propose and commit) over b rows at N, from a short batched
    decode of the prompts (repeated to fill b rows)."""
    rows = [prompts[i % len(prompts)] for i in range(b)]
    _, s = generate(target, rows, steps, proposer, n, eos_token_ids=())
    return s.draft_s / s.iterations if s.iterations else 0.0


def predict(candidates, verify_s, concurrency) -> list[dict]:
    """Expected output tokens/s of every (candidate, N) at every concurrency, and of no speculation."""
    rows = [{"candidate": "no speculation", "n": 0, "concurrency": b, "tokens_per_s": b / verify_s[b][1]}
            for b in concurrency]
    for c in candidates:
        for n, m in c["by_n"].items():
            a = m["acceptance"]
            for b in concurrency:
                seconds = a["share"] * (verify_s[b][n + 1] + m["draft_s"][b]) + (1 - a["share"]) * verify_s[b][1]
                rows.append({"candidate": c["name"], "n": n, "concurrency": b,
                             "tokens_per_s": b * a["tokens_per_step"] / seconds})
    return rows


def recommend(predictions, candidates, concurrency) -> dict:
    """For each concurrency the best prediction and the runner-up (another candidate), each with
    its --speculative-config (None: serve without speculation)."""
    configs = {c["name"]: c["config"] for c in candidates}
    out = {}
    for b in concurrency:
        ranked = sorted((p for p in predictions if p["concurrency"] == b), key=lambda p: -p["tokens_per_s"])
        best = ranked[0]
        runner = next(p for p in ranked if p["candidate"] != best["candidate"]) if len(ranked) > 1 else None

        def entry(p):
            if p is None:
                return None
            config = None if p["n"] == 0 else {**configs[p["candidate"]], "num_speculative_tokens": p["n"]}
            return {**p, "config": config}

        out[b] = {"best": entry(best), "runner_up": entry(runner)}
    return out


def check_in_vllm(target, candidates, recommendations, prompts, cfg, out: Path) -> list[dict]:
    """The best and the runner-up at each concurrency served in vLLM (greedy, fp32, at most b
    requests in flight) on the same prompts: measured output tokens/s beside the prediction."""
    jobs, which = [], []
    work = out.parent / f".{out.name}.vllm"
    work.mkdir(parents=True, exist_ok=True)
    for b, r in recommendations.items():
        for role in ("best", "runner_up"):
            p = r[role]
            if p is None:
                continue
            config = p["config"] or {}
            job = {"target": target.hf_dir, "prompts": prompts, "out": str(work / f"c{b}-{role}.json"),
                   "max_new_tokens": cfg.max_new_tokens, "max_num_seqs": b,
                   "num_speculative_tokens": config.get("num_speculative_tokens", 0)}
            if config.get("method") == "ngram":
                job.update({k: v for k, v in config.items() if k != "num_speculative_tokens"})
            elif config:
                job.update({"draft": config["model"], "method": config["method"]})
            jobs.append(job)
            which.append((b, role, p))
    results = checks.run_vllm_jobs(jobs)
    rows = []
    for (b, role, p), r in zip(which, results):
        measured = sum(len(o) for o in r["outputs"]) / r["seconds"]["generate"]
        rows.append({"concurrency": b, "role": role, "candidate": p["candidate"], "n": p["n"],
                     "predicted_tokens_per_s": p["tokens_per_s"], "measured_tokens_per_s": measured,
                     "error": p["tokens_per_s"] / measured - 1, "vllm_tau": (r["spec"] or {}).get("tau")})
    return rows


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def plot(report: dict, path: Path) -> None:
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    conc = report["concurrency"]
    names = list(dict.fromkeys(p["candidate"] for p in report["predictions"]))
    for name in names:
        best = [max(p["tokens_per_s"] for p in report["predictions"] if p["candidate"] == name
                    and p["concurrency"] == b) for b in conc]
        ax.plot(conc, best, marker="o", label=name)
    ax.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="expected output tokens/s",
           xticks=conc, xticklabels=[str(b) for b in conc], title=f"{report['target']} on {report['dataset']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def format_report(r: dict) -> str:
    rows = [f"{r['target']} on {r['dataset']} ({r['prompts']} prompts, {r['max_new_tokens']} tokens each); costs "
            f"measured in {r['costs_measured_in']}"]
    for c in r["candidates"]:
        taus = ", ".join(f"N={n}: τ {m['acceptance']['tau']:.2f}" + (f" in {m['acceptance']['share']:.0%} of steps"
                                                                     if m["acceptance"]["share"] < 1 else "")
                         for n, m in c["by_n"].items())
        rows.append(f"  {c['name']}: {taus}")
    for b, rec in r["recommendations"].items():
        best, runner = rec["best"], rec["runner_up"]
        say = lambda p: f"{p['candidate']}" + (f" N={p['n']}" if p["n"] else "") + f" {p['tokens_per_s']:.1f} tok/s"  # noqa: E731
        rows.append(f"  concurrency {b}: serve {say(best)}" + (f" (runner-up: {say(runner)})" if runner else ""))
        rows.append("    " + (f"--speculative-config '{json.dumps(best['config'])}'" if best["config"]
                              else "serve without speculation"))
    for v in r.get("vllm_check", []):
        rows.append(f"  vLLM, concurrency {v['concurrency']}, {v['role']}: {v['candidate']} N={v['n']}: measured "
                    f"{v['measured_tokens_per_s']:.1f} tok/s, predicted {v['predicted_tokens_per_s']:.1f} "
                    f"({v['error']:+.0%})")
    return "\n".join(rows)


def spread(argv: list[str]) -> list[str]:
    """`--drafts A B C` as `--drafts A --drafts B --drafts C`, `--concurrency 1,4,16` as a list."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--drafts":
            i += 1
            while i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
                out += ["--drafts", argv[i]]
                i += 1
            continue
        if argv[i] == "--concurrency" and i + 1 < len(argv) and not argv[i + 1].startswith("["):
            out += ["--concurrency", f"[{argv[i + 1]}]"]
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    argv = spread(list(sys.argv[1:] if argv is None else argv))
    cfg = parse_flags(CompareConfig, argv, __doc__, FLAGS, SWITCHES, repeated=REPEATED, prog="draftsmith compare")
    report = run(cfg, argv)
    print(format_report(report))
    print(f"  written to {cfg.output_dir}/report.json, compare.png and serve-c*.json")


if __name__ == "__main__":
    main()
