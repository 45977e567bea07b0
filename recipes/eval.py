"""Measure a draft with the in-tree lossless speculative decoder: τ, per-position
acceptance (counted as vLLM counts it), draft vs verify time, tokens/s, speedup over
in-tree autoregressive decoding on the same prompts, and the best num_speculative_tokens
from the draft's measured per-round cost.

    draftsmith eval --target smollm2-135m-instruct --draft ngram --dataset gsm8k --num-draft-tokens 4
    draftsmith eval --draft runs/smollm2-135m/eagle3 --dataset humaneval --temperature 0.7 num_prompts=8
    draftsmith eval --draft runs/demo/export-fp8 --dataset mtbench      (an export: BF16, or FP8 simulated)
    draftsmith eval --draft runs/smollm2-135m/dspark --ablation without_markov [--draft-option draft_topk=64]
    draftsmith eval --draft runs/smollm2-135m/eagle3 --context-buckets 1024,2048,4096,8192   (τ per context length)
    python recipes/eval.py --config recipes/configs/smollm2-135m/eval.yaml

Without --num-draft-tokens, an export is measured at the N it records (the N of its serve
command), a trained draft at the positions it was trained on (EAGLE-3: its TTT steps; DFlash:
its block's K-1; DSpark: its block's K).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

from export import formats
from export.load import check_options, load_proposer
from recipes._common import (
    default_num_draft_tokens,
    one_line_errors,
    parse_flags,
    prompt_encoder,
    prompt_ids,
    target_for,
)
from trainer.config import EvalConfig, to_yaml
from trainer.data.buckets import context_prompts
from trainer.data.chat import read_template, template_file
from trainer.data.evalsets import dataset_file, load_prompts
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json, atomic_write_text, check_space, ensure_dir, guard_output, write_run_files
from trainer.metrics import bucket_report
from trainer.serving import CostModel, best_num_draft_tokens, speculation_cutoff
from trainer.speculative import DecodeStats, NGramDraft, Sampling, measure, measure_with_baseline
from trainer.target import load_target, resolve_target

FLAGS = ("target", "draft", "dataset", "num_draft_tokens", "temperature", "top_p", "top_k", "num_prompts",
         "max_new_tokens", "batch_size", "context_buckets", "output_dir", "draft_sampling", "chat_template")
SWITCHES = {"--no-chat-template": "no_chat_template=true"}
REPEATED = {"--draft-option": ("draft_options", "KEY=VALUE"), "--ablation": ("ablations", "NAME")}


def make_draft(cfg: EvalConfig, target, **overrides):
    """The proposer under test (with `overrides` on top of cfg.draft_options) and its name."""
    options = {**cfg.draft_options, **overrides}
    if cfg.draft == "ngram":
        options = check_options(NGramDraft, options, "the n-gram baseline")
        if cfg.ablations:
            raise DraftsmithError(f"ablations {cfg.ablations}: the n-gram baseline declares none")
        draft = NGramDraft(**options)
        return draft, f"ngram (prompt lookup, n {draft.min_n}..{draft.max_n}, as vLLM's ngram)"
    return load_proposer(cfg.draft, target, cfg.draft_sampling, cfg.seed, **options)


def run(cfg: EvalConfig, argv=None) -> dict:
    # resolve: the target (once: the one the draft records, unless --target names another)
    source = resolve_target(target_for(cfg.draft, cfg.target))
    # check, before the measurement: a given template, the report folder
    read_template(cfg.chat_template, "eval --chat-template")
    out = check_output_dir(cfg, source)
    # produce: both decodes of the same prompts (and the ablations), the cost model, the best N
    target = load_target(source)
    draft, draft_name = make_draft(cfg, target)
    unknown = sorted(set(cfg.ablations) - set(draft.ABLATIONS))
    if unknown:
        raise DraftsmithError(f"ablation(s) {', '.join(unknown)} are not declared by {draft_name}; it declares "
                              f"{', '.join(draft.ABLATIONS) or 'none'}")
    N = default_num_draft_tokens(cfg.num_draft_tokens, draft)
    if cfg.context_buckets:  # τ per context length: each bucket's own prompts, built to its length
        sets, texts = bucket_prompts(cfg, target)
    else:
        sets, texts = {None: prompt_ids(target, load_prompts(cfg.dataset, cfg.num_prompts), cfg.draft,
                                        cfg.chat_template, cfg.no_chat_template, "eval --chat-template")}, None
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    common = dict(sampling=sampling, eos_token_ids=target.eos_token_ids, batch_size=cfg.batch_size, seed=cfg.seed)
    ar, sp, buckets = DecodeStats(0), DecodeStats(N), []
    for L, some in sets.items():  # each bucket decoded as a run of its own (the same seeds): the whole merged
        where = f" ({L}-token context)" if L else ""
        a, s = measure_with_baseline(target, draft, some, cfg.max_new_tokens, N,
                                     progress=f"eval: autoregressive and speculative{where}", **common)
        ar.merge(a)
        sp.merge(s)
        if L:
            buckets.append(bucket_report(L, [len(p) for p in some], s, a))
    prompts = [p for some in sets.values() for p in some]
    ablations = {}
    for name in cfg.ablations:  # the same draft with the options the algorithm declares for `name`
        variant, _ = make_draft(cfg, target, **draft.ABLATIONS[name])
        ab = measure(target, variant, prompts, cfg.max_new_tokens, N, progress=f"eval: {name}", **common)
        ablations[name] = {"tau": ab.tau, "conditional_acceptance": ab.conditional_acceptance,
                           "cumulative_acceptance": ab.cumulative_acceptance, "tokens_per_s": ab.tokens_per_s,
                           "counts": ab.counts()}
    cost = CostModel.fit(ar, sp, N, parallel=draft.parallel)
    coverage = sp.rounds / sp.iterations if sp.iterations else 1.0  # n-gram: the steps that found a match
    best = best_num_draft_tokens(sp.cumulative_acceptance, sp.conditional_acceptance, cost, coverage)
    report = {
        "target": target.name, "target_sha256": target.content_hash, "draft": draft_name,
        "dataset": cfg.dataset, "prompts": len(prompts), "num_draft_tokens": N,
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                     "draft_sampling": cfg.draft_sampling},
        "draft_options": dict(getattr(draft, "options", cfg.draft_options)),  # an export's served ones included
        "tau": sp.tau, "cumulative_acceptance": sp.cumulative_acceptance,
        "conditional_acceptance": sp.conditional_acceptance,
        "counts": sp.counts(),  # vLLM's num_drafts, num_accepted_tokens, accepted per position
        "speculative": {"tokens": sp.generated, "seconds": sp.total_s, "tokens_per_s": sp.tokens_per_s,
                        "draft_s": sp.draft_s, "propose_s": sp.propose_s, "commit_s": sp.commit_s,
                        "verify_s": sp.verify_s, "rounds": sp.rounds, "steps": sp.iterations,
                        "coverage": coverage},
        "autoregressive": {"tokens": ar.generated, "seconds": ar.total_s, "tokens_per_s": ar.tokens_per_s},
        "speedup": sp.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0,
        "cost_model": {"draft_fixed_s": cost.draft_fixed, "draft_per_token_s": cost.draft_per_token,
                       "verify_one_s": cost.verify_one, "verify_max_s": cost.verify_max, "parallel": draft.parallel},
        "best_num_draft_tokens": best,
        **({"ablations": ablations} if ablations else {}),
    }
    if buckets:  # in-tree tokens/s per bucket: where plain decoding is the choice on this machine (a prediction
        # for serving: `draftsmith compare --context-buckets` measures it served)
        report.update(max_new_tokens=cfg.max_new_tokens)
        report.update(dataset=f"context buckets {','.join(map(str, cfg.context_buckets))} (documents and a question "
                              "from ShareGPT, trainer/data/buckets.py)", context_buckets=buckets,
                      context_cutoff=speculation_cutoff([{"context": b["context"], "runs": [b["tokens_per_s"]],
                                                          "plain_runs": [b["plain_tokens_per_s"]]} for b in buckets]))
    # publish: the report, its plot and run files (recorded in the export they measure, when inside it)
    ensure_dir(out, "output_dir")
    atomic_write_json(out / "report.json", report)
    if texts:  # the bucket prompts as built: `--dataset jsonl:` of one bucket's measures them again
        atomic_write_text(out / CONTEXT_PROMPTS, "".join(json.dumps({"context": L, "prompt": t}) + "\n"
                                                         for L, t in texts))
    plot(report, out / "acceptance.png")
    write_run_files(out, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash,
                                        "seed": cfg.seed}, argv, stage="eval")
    export_dir = Path(cfg.draft)
    if (export_dir / formats.EXPORT_MANIFEST).is_file() and out.resolve().is_relative_to(export_dir.resolve()):
        # a report inside the export it measured: recorded there, so upload can trust it
        formats.record_added_files(export_dir, [out / n for n in ("report.json", "acceptance.png", "config.yaml",
                                                                  "command.txt", "provenance.json")]
                                   + ([out / CONTEXT_PROMPTS] if texts else []))
    return report


REPORT_BYTES = 8 << 20  # report.json, acceptance.png and the run files: well under this
CONTEXT_PROMPTS = "context-prompts.jsonl"  # with --context-buckets: {"context", "prompt"} per prompt built


def bucket_prompts(cfg: EvalConfig, target) -> tuple[dict[int, list[list[int]]], list[tuple[int, str]]]:
    """Per context bucket L, cfg.num_prompts prompts of L - max_new_tokens tokens under the
    prompts' chat template (trainer/data/buckets.py), and every prompt's text with its bucket."""
    most = target.model.config.get_text_config().max_position_embeddings
    if max(cfg.context_buckets) > most:
        raise DraftsmithError(f"context bucket {max(cfg.context_buckets)} is longer than {target.name}'s context, "
                              f"{most} tokens (max_position_embeddings in its config.json); use buckets up to {most}")
    encode = prompt_encoder(target, cfg.draft, cfg.chat_template, cfg.no_chat_template, "eval --chat-template")
    sets, texts = {}, []
    for L in cfg.context_buckets:
        some, sets[L] = context_prompts(target.tokenizer, encode, L - cfg.max_new_tokens, cfg.num_prompts)
        texts += [(L, t) for t in some]
    return sets, texts


def check_output_dir(cfg: EvalConfig, source) -> Path:
    """The report folder must be writable, never an input of the run (it may sit inside the
    export it measures, which records the report; inside any other export, never), only ever
    an eval folder (eval replaces its own report by default, nothing else), and, unless
    overwrite, hold no earlier report."""
    draft = None if cfg.draft == "ngram" else cfg.draft
    guard_output(cfg.output_dir, [draft, dataset_file(cfg.dataset), template_file(cfg.chat_template), source.path],
                 "eval", overwrite=True, allow_inside=[draft] if draft else [])
    out = Path(cfg.output_dir)
    where = out.resolve()
    export = next((p for p in (where, *where.parents) if (p / formats.EXPORT_MANIFEST).is_file()), None)
    if export is not None and (draft is None or export != Path(draft).resolve()):
        raise DraftsmithError(f"output_dir '{out}' is inside the export '{export}', which holds only reports of "
                              f"itself (its recorded eval/, which upload trusts); measure that export there (--draft "
                              f"{export}), or choose an --output-dir outside it")
    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"output_dir '{out}' is a file, not a folder; choose another --output-dir")
    check_space(out, REPORT_BYTES, f"eval's report into '{out}'")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DraftsmithError(f"output_dir '{out}' cannot be created: '{blocker}' is a file, not a folder")
    if out.is_dir() and not cfg.overwrite and any(out.iterdir()):
        raise DraftsmithError(f"output_dir '{out}' exists; pass overwrite=true to replace its report")
    return out


def plot(report: dict, path: Path) -> None:
    fig = Figure(figsize=(10, 3.8))  # no pyplot: nothing global, no display backend
    a, b = fig.subplots(1, 2)
    pos = list(range(1, report["num_draft_tokens"] + 1))
    a.bar([p - 0.2 for p in pos], report["conditional_acceptance"], width=0.4, label="conditional")
    a.bar([p + 0.2 for p in pos], report["cumulative_acceptance"], width=0.4, label="cumulative")
    a.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), xticks=pos,
          title=f"{report['draft']} on {report['dataset']}: τ = {report['tau']:.2f}")
    for i, (name, ab) in enumerate(report.get("ablations", {}).items()):  # variants the algorithm declares
        a.plot(pos, ab["conditional_acceptance"], "_", color=f"C{i + 2}", markersize=14, mew=2,
               label=f"conditional, {name}")
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
    c = r["counts"]
    rows.insert(2, f"  rounds {c['num_drafts']}, accepted {c['num_accepted_tokens']}, per position "
                   f"{c['accepted_per_position']} (vLLM's num_drafts, num_accepted_tokens, per-position counts)")
    coverage = r["speculative"].get("coverage", 1.0)
    if coverage < 1:
        rows.insert(3, f"  {coverage:.0%} of {r['speculative']['steps']} decoding steps had a proposal (the others "
                       "found no n-gram match: one token each, no round)")
    if r.get("context_buckets"):  # τ per context length
        rows += ["  context  prompt tokens    τ     tokens/s (plain)   speedup  conditional acceptance by position"]
        rows += [f"  {b['context']:7d}  {b['prompt_tokens'][1]:13d}  {b['tau']:5.2f}  {b['tokens_per_s']:8.1f} "
                 f"({b['plain_tokens_per_s']:.1f})  {b['speedup']:7.2f}x  "
                 + " ".join(f"{a:.2f}" for a in b["conditional_acceptance"]) for b in r["context_buckets"]]
        cut = r["context_cutoff"]
        rows.append("  in-tree, this machine: " + (
            f"speculation pays up to {cut['pays_up_to']} tokens of context" if cut["pays_up_to"] else
            "speculation does not pay at the shortest bucket")
            + (f"; plain decoding from {cut['plain_from']}" if cut["plain_from"] else " (every bucket measured)"))
    for name, a in r.get("ablations", {}).items():
        rows += [f"  {name}: τ {a['tau']:.3f} (the draft as trained: {r['tau']:.3f}, {r['tau'] / a['tau'] - 1:+.1%})"
                 if a["tau"] else f"  {name}: no rounds",
                 "  conditional   " + " ".join(f"{x:6.3f}" for x in a["conditional_acceptance"]) + f"   ({name})"]
    return "\n".join(rows)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [f"[{a}]" if i and argv[i - 1] == "--context-buckets" and not a.startswith("[") else a  # 1024,2048: a list
            for i, a in enumerate(argv)]
    cfg = parse_flags(EvalConfig, argv, __doc__, FLAGS, SWITCHES, repeated=REPEATED, prog="draftsmith eval")
    report = run(cfg, argv)
    print(format_report(report))
    print(f"  written to {cfg.output_dir}/report.json and acceptance.png")


if __name__ == "__main__":
    main()
