"""Measure a draft with the in-tree lossless speculative decoder: τ, per-position
acceptance, draft vs verify time, tokens/s, speedup over in-tree autoregressive
decoding on the same prompts, and the best num_speculative_tokens.

    draftsmith eval --target smollm2-135m-instruct --draft ngram --dataset gsm8k --num-draft-tokens 4
    draftsmith eval --draft runs/smollm2-135m/eagle3 --dataset humaneval --temperature 0.7 num_prompts=8
    draftsmith eval --draft runs/demo/export-fp8 --dataset mtbench      (an export: BF16, or FP8 simulated)
    draftsmith eval --draft runs/smollm2-135m/dspark --num-draft-tokens 7 --markov-ablation [--draft-topk 64]
    python recipes/eval.py --config recipes/configs/smollm2-135m/eval.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

from export import formats
from recipes._common import load_proposer, one_line_errors, parse_flags
from trainer.config import EvalConfig, to_yaml
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json, ensure_dir, write_run_files

FLAGS = {"--target": ("target", "the target: an embedded alias, an HF model folder or a .gguf file"),
         "--draft": ("draft", "'ngram', a trained draft folder (recipes/train.py) or an export folder"),
         "--dataset": ("dataset", "gsm8k, math500, humaneval, mtbench, sharegpt or jsonl:PATH"),
         "--num-draft-tokens": ("num_draft_tokens", "draft tokens per round (vLLM's num_speculative_tokens)"),
         "--temperature": ("temperature", "sampling temperature; 0 = greedy"),
         "--top-p": ("top_p", "nucleus sampling mass"), "--top-k": ("top_k", "top-k sampling; 0 = off"),
         "--num-prompts": ("num_prompts", "prompts decoded"),
         "--max-new-tokens": ("max_new_tokens", "tokens generated per prompt"),
         "--batch-size": ("batch_size", "prompts decoded together"),
         "--output-dir": ("output_dir", "where report.json and acceptance.png go (checked before decoding)"),
         "--draft-sampling": ("draft_sampling", "greedy (vLLM's default: the draft's argmax) or probabilistic"),
         "--draft-topk": ("draft_topk", "DSpark: apply the Markov correction to the top-k base candidates only")}
SWITCHES = {"--markov-ablation": ("markov_ablation=true",
                                  "DSpark: also decode without the Markov head and print both acceptance curves")}


def make_draft(cfg: EvalConfig, target, markov: bool = True):
    from trainer.speculative import NGramDraft

    if cfg.draft == "ngram":
        if cfg.draft_topk is not None or cfg.markov_ablation:
            raise DraftsmithError("draft_topk and markov_ablation apply to DSpark drafts, not ngram")
        return NGramDraft(), "ngram (prompt lookup)"
    options = {}
    if cfg.draft_topk is not None or cfg.markov_ablation or not markov:
        options = {"markov": markov, "draft_topk": cfg.draft_topk}
    draft, name = load_proposer(cfg.draft, target, cfg.draft_sampling, cfg.seed, **options)
    if draft.max_draft_tokens is not None and cfg.num_draft_tokens > draft.max_draft_tokens:
        raise DraftsmithError(f"num_draft_tokens={cfg.num_draft_tokens} is more than this draft proposes "
                              f"({draft.max_draft_tokens}); use at most {draft.max_draft_tokens}")
    return draft, name


def run(cfg: EvalConfig, argv=None) -> dict:
    from trainer.data.evalsets import chat_prompt_ids, load_prompts
    from trainer.metrics import CostModel, best_num_draft_tokens
    from trainer.speculative import Sampling, measure
    from trainer.target import load_target

    out = check_output_dir(cfg)  # before the measurement, not after it
    target = load_target(cfg.target)
    draft, draft_name = make_draft(cfg, target)
    tok = target.tokenizer
    prompts = chat_prompt_ids(tok, load_prompts(cfg.dataset, cfg.num_prompts))
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    common = dict(sampling=sampling, eos_token_ids=target.eos_token_ids, batch_size=cfg.batch_size, seed=cfg.seed)
    ar = measure(target, None, prompts, cfg.max_new_tokens, progress="eval: autoregressive", **common)
    sp = measure(target, draft, prompts, cfg.max_new_tokens, cfg.num_draft_tokens, progress="eval: speculative",
                 **common)
    N = cfg.num_draft_tokens
    ablation = None
    if cfg.markov_ablation:  # the same backbone, base logits alone: what the Markov head adds
        base, _ = make_draft(cfg, target, markov=False)
        ab = measure(target, base, prompts, cfg.max_new_tokens, N, progress="eval: without the Markov head",
                     **common)
        ablation = {"without_markov": {"tau": ab.tau, "conditional_acceptance": ab.conditional_acceptance,
                                       "cumulative_acceptance": ab.cumulative_acceptance,
                                       "tokens_per_s": ab.tokens_per_s}}
    cost = CostModel(draft_per_token=sp.draft_s / max(sp.iterations * N, 1),
                     verify_one=ar.verify_s / max(ar.iterations, 1),
                     verify_max=sp.verify_s / max(sp.iterations, 1), n_max=N)
    best = best_num_draft_tokens(sp.cumulative_acceptance, sp.conditional_acceptance, cost)
    report = {
        "target": target.name, "target_sha256": target.content_hash, "draft": draft_name,
        "dataset": cfg.dataset, "prompts": len(prompts), "num_draft_tokens": N,
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                     "draft_sampling": cfg.draft_sampling},
        "tau": sp.tau, "cumulative_acceptance": sp.cumulative_acceptance,
        "conditional_acceptance": sp.conditional_acceptance,
        "speculative": {"tokens": sp.generated, "seconds": sp.total_s, "tokens_per_s": sp.tokens_per_s,
                        "draft_s": sp.draft_s, "verify_s": sp.verify_s, "rounds": sp.rounds},
        "autoregressive": {"tokens": ar.generated, "seconds": ar.total_s, "tokens_per_s": ar.tokens_per_s},
        "speedup": sp.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0,
        "best_num_draft_tokens": best,
        **({"ablation": ablation} if ablation else {}),
    }
    ensure_dir(out, "output_dir")
    atomic_write_json(out / "report.json", report)
    plot(report, out / "acceptance.png")
    write_run_files(out, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash,
                                        "seed": cfg.seed}, argv)
    export_dir = Path(cfg.draft)
    if (export_dir / formats.EXPORT_MANIFEST).is_file() and out.resolve().is_relative_to(export_dir.resolve()):
        # a report inside the export it measured: recorded there, so upload can trust it
        formats.record_added_files(export_dir, [out / n for n in ("report.json", "acceptance.png", "config.yaml",
                                                                  "command.txt", "provenance.json")])
    return report


def check_output_dir(cfg: EvalConfig) -> Path:
    """The report folder must be writable and, unless overwrite, hold no earlier report."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"output_dir '{out}' is a file, not a folder; choose another --output-dir")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DraftsmithError(f"output_dir '{out}' cannot be created: '{blocker}' is a file, not a folder")
    if out.is_dir() and not cfg.overwrite and any(out.iterdir()):
        raise DraftsmithError(f"output_dir '{out}' exists; pass overwrite=true to replace its report")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    pos = list(range(1, report["num_draft_tokens"] + 1))
    a.bar([p - 0.2 for p in pos], report["conditional_acceptance"], width=0.4, label="conditional")
    a.bar([p + 0.2 for p in pos], report["cumulative_acceptance"], width=0.4, label="cumulative")
    a.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), xticks=pos,
          title=f"{report['draft']} on {report['dataset']}: τ = {report['tau']:.2f}")
    if report.get("ablation"):  # DSpark: the same backbone without its Markov head
        a.plot(pos, report["ablation"]["without_markov"]["conditional_acceptance"], "k_", markersize=14, mew=2,
               label="conditional, no Markov head")
    a.legend()
    curve = report["best_num_draft_tokens"]["curve"]
    b.plot([c["n"] for c in curve], [c["expected_tau"] for c in curve], marker="o", label="expected τ")
    b2 = b.twinx()
    b2.plot([c["n"] for c in curve], [c["tokens_per_s"] for c in curve], marker="s", color="C1",
            label="expected tokens/s")
    b.set(xlabel="num_speculative_tokens", ylabel="τ", title=f"best N = {report['best_num_draft_tokens']['best_n']}")
    b2.set_ylabel("tokens/s")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def format_report(r: dict) -> str:
    best = r["best_num_draft_tokens"]
    rows = [f"{r['draft']} on {r['dataset']} ({r['prompts']} prompts), target {r['target']}, "
            f"N={r['num_draft_tokens']}, temperature {r['sampling']['temperature']}",
            f"  τ (mean accepted length, bonus included)  {r['tau']:.3f}",
            "  position      " + " ".join(f"{k:>6}" for k in range(1, r["num_draft_tokens"] + 1)),
            "  conditional   " + " ".join(f"{a:6.3f}" for a in r["conditional_acceptance"]),
            "  cumulative    " + " ".join(f"{a:6.3f}" for a in r["cumulative_acceptance"]),
            f"  tokens/s: speculative {r['speculative']['tokens_per_s']:.1f}, autoregressive "
            f"{r['autoregressive']['tokens_per_s']:.1f}, speedup {r['speedup']:.2f}x "
            f"(draft {r['speculative']['draft_s']:.1f} s, verify {r['speculative']['verify_s']:.1f} s)",
            "  expected tokens/s by N: " + ", ".join(f"{c['n']}: {c['tokens_per_s']:.1f}" for c in best["curve"]),
            f"  best num_speculative_tokens: {best['best_n']}"
            + (f"; acceptance collapses at position {best['collapse_position']}" if best["collapse_position"] else "")]
    if r.get("ablation"):
        a = r["ablation"]["without_markov"]
        rows += [f"  without the Markov head (same backbone): τ {a['tau']:.3f} (with it {r['tau']:.3f}, "
                 f"{r['tau'] / a['tau'] - 1:+.1%})" if a["tau"] else "  without the Markov head: no rounds",
                 "  conditional   " + " ".join(f"{x:6.3f}" for x in a["conditional_acceptance"]) + "   (no Markov)"]
    return "\n".join(rows)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_flags(EvalConfig, argv, __doc__, FLAGS, SWITCHES, prog="draftsmith eval")
    report = run(cfg, argv)
    print(format_report(report))
    print(f"  written to {cfg.output_dir}/report.json and acceptance.png")


if __name__ == "__main__":
    main()
