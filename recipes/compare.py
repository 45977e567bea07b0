"""Which draft to serve, at which N, at which load: every export given, vLLM's n-gram and no
speculation, measured on the user's prompts on this machine; for each concurrency the
configuration that serves the most output tokens/s, and the --speculative-config that serves it.

    draftsmith compare --drafts runs/demo/export-bf16 runs/demo/export-fp8 --dataset gsm8k --concurrency 1,4,16
    draftsmith compare --drafts runs/demo/export-bf16 --no-vllm     (no vLLM here: in-tree costs, a prediction)

What is measured, and how:
- acceptance: each candidate decoded by the in-tree decoder (which counts what vLLM counts:
  tests/test_vllm.py) on the prompts, one at a time, greedy, at every N from 1 to the positions
  it was trained on, each N measured (a block draft's proposals change with N); the n-gram up to
  the largest N of the drafts'. Per candidate and N: τ, the share of decoding steps with a
  proposal (below 1 only for the n-gram, which proposes nothing without a match), the tokens per
  decoding step, 1 + share x (τ - 1), and each prompt's steps.
- served in vLLM (the default): every candidate and no speculation served on the same prompts at
  every N and concurrency b by a client keeping b requests in flight, one engine per candidate
  (N changed through vLLM's dynamic speculative decoding), every engine step timed. The served
  tokens/s decide the recommendation; vLLM's counts are checked against the in-tree decoder's and
  its outputs against its plain decoding's (lossless) at every N. The prediction printed beside
  (its error says whether acceptance and step cost explain served speed): the in-tree steps of
  each prompt replayed through vLLM's measured step times at k requests in flight and its cost
  per prompt token (trainer/serving.py `simulate`).
- --no-vllm: costs timed in-tree (the target's forward over b rows of width N + 1, each draft's
  round), expected tokens/s (Leviathan et al., 2023, §3.4) b x tokens per step / (share x (V(b, N+1)
  + D(b, N)) + (1 - share) x V(b, 1)); a prediction only, and a rough one (README).
Writes OUTPUT_DIR/report.json, compare.png (tokens/s against concurrency, one line per candidate
at its best N), serve-c{b}.json (the --speculative-config for each concurrency, or null: serve
without speculation) and serve-dynamic.json (per draft, its best N at each load as vLLM's
batch-size schedule, `num_speculative_tokens_per_batch_size`).
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

from export import formats, policy
from export.hub import COMPARE_SIGNED
from export.load import load_proposer
from recipes._common import one_line_errors, parse_flags, prompt_encoder, prompt_ids, target_for
from trainer import serving
from trainer.config import CompareConfig, to_yaml
from trainer.data.buckets import context_prompts
from trainer.data.chat import read_template, template_file
from trainer.data.evalsets import dataset_file, load_prompts
from trainer.errors import DraftsmithError
from trainer.families import served_max_model_len
from trainer.io import (
    atomic_write_json,
    cache_root,
    check_space,
    ensure_dir,
    fresh_output_dir,
    guard_output,
    publish_dir,
    sha256_file,
    write_run_files,
)
from trainer.metrics import sampled_acceptance_agreement
from trainer.speculative import DecodeStats, NGramDraft, Sampling, TargetSession, generate
from trainer.target import load_target, resolve_target
from trainer.vllm import checks
from trainer.vllm.env import require_vllm_python

FLAGS = ("dataset", "num_prompts", "max_new_tokens", "concurrency", "context_buckets", "output_dir", "chat_template")
SWITCHES = {"--no-vllm": "vllm=false", "--no-ngram": "ngram=false", "--write-policy": "write_policy=true"}
REPEATED = {"--drafts": ("drafts", "EXPORT")}


def run(cfg: CompareConfig, argv=None) -> dict:
    # resolve: the target the first draft records (every other must record the same, checked at load)
    source = resolve_target(target_for(cfg.drafts[0] if cfg.drafts else "ngram", None))
    # check, before any measurement: the exports, a given template, the report folder
    read_template(cfg.chat_template, "compare --chat-template")
    for d in cfg.drafts:
        if not (Path(d) / "draftsmith_export.json").is_file():
            raise DraftsmithError(f"--drafts '{d}' is not an export (no draftsmith_export.json): compare measures "
                                  "what vLLM serves; export a trained draft first (draftsmith export)")
    if cfg.vllm:
        require_vllm_python("compare (it serves every candidate in vLLM; --no-vllm predicts from in-tree costs alone)")
    guard_output(cfg.output_dir, [*cfg.drafts, dataset_file(cfg.dataset), template_file(cfg.chat_template),
                                  source.path], "compare", overwrite=cfg.overwrite)
    seen = [str(Path(d).expanduser().resolve()) for d in cfg.drafts]
    twice = next((d for i, d in enumerate(cfg.drafts) if seen[i] in seen[:i]), None)
    if twice is not None:
        raise DraftsmithError(f"compare --drafts names '{twice}' twice; name each export once")
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not cfg.overwrite:
        raise DraftsmithError(f"compare --output-dir '{out}' exists; pass overwrite=true to replace it whole, or "
                              "choose another folder")
    check_space(out.parent if not out.exists() else out, REPORT_BYTES, "compare's report")
    # produce: the candidates, their acceptance at every N, the costs, the model, the recommendation
    target = load_target(source)
    candidates = make_candidates(cfg, target)
    if cfg.vllm:
        serving_dtype(cfg, candidates)  # an FP8 export with dtype=float32: refused before any measurement
    prompts = prompt_ids(target, load_prompts(cfg.dataset, cfg.num_prompts), cfg.drafts[0] if cfg.drafts else
                         "ngram", cfg.chat_template, False, "compare --chat-template")
    if max(cfg.concurrency) > len(prompts):
        raise DraftsmithError(f"compare --concurrency {max(cfg.concurrency)} needs that many prompts in flight; "
                              f"--num-prompts gives {len(prompts)} of {cfg.dataset}: raise it or lower the concurrency")
    print(f"compare: {len(candidates)} candidates on {len(prompts)} prompts of {cfg.dataset}, concurrency "
          f"{cfg.concurrency}", file=sys.stderr)
    by_name = {c["name"]: c for c in candidates}
    for c in candidates:
        if c.get("knob") and not c["in_tree_model"]:  # the in-tree decoder has no such knob: its draft's counts
            c["by_n"] = {n: {"acceptance": m["acceptance"]} for n, m in by_name[c["base"]]["by_n"].items()}
            continue
        c["by_n"] = {}
        for n in c["ns"]:
            print(f"compare: {c['name']} at N={n}, in-tree", file=sys.stderr)
            c["by_n"][n] = {"acceptance": acceptance(target, c["proposer"], prompts, cfg.max_new_tokens, n,
                                                     cfg.temperature)}
    report = {"target": target.name, "target_sha256": target.content_hash, "dataset": cfg.dataset,
              "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "concurrency": cfg.concurrency,
              "temperature": cfg.temperature, "machine": machine(), "repeats": cfg.repeats if cfg.vllm else None}
    if cfg.vllm:
        report.update(costs_measured_in=f"vLLM (every candidate served at every N and concurrency, the target in "
                                        f"{serving_dtype(cfg, candidates)})",
                      **served_in_vllm(target, candidates, prompts, cfg))
    else:
        report.update(costs_measured_in="the in-tree decoder (--no-vllm: nothing served; vLLM's own step times "
                                        "differ, see the README)", **in_tree_costs(target, candidates, prompts, cfg))
    report["knobs"] = knob_lines(cfg, candidates)
    candidates[:] = [c for c in candidates if not c.get("unavailable")]  # a knob this vLLM lacks: one line, above
    report["candidates"] = [{k: v for k, v in c.items() if k != "proposer"} for c in candidates]
    report["recommendations"] = recommendations = serving.recommend(report["predictions"], candidates, cfg.concurrency)
    report["dynamic_configs"] = serving.dynamic_configs(cfg.concurrency, candidates, report["predictions"])
    if cfg.context_buckets:  # τ and tokens/s per context length, and where serving without speculation wins
        report.update(by_context(cfg, target, candidates))
    # publish: the report, the plot, a serving config per concurrency, the run files, built in a
    # sibling folder that replaces the output whole (no file of an earlier comparison stays beside
    # this report); the report's and the plot's sha256 in provenance.json (upload --compare checks them)
    stage = fresh_output_dir(out, overwrite=True, what="compare --output-dir")
    try:
        atomic_write_json(stage / "report.json", report)
        for b, r in recommendations.items():
            atomic_write_json(stage / f"serve-c{b}.json", {"concurrency": b, "speculative_config": r["best"]["config"],
                                                           **policy.context_note(report, r["best"]["candidate"], b)})
        atomic_write_json(stage / "serve-dynamic.json", report["dynamic_configs"])
        plot(report, stage / "compare.png")
        write_run_files(stage, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash,
                                              "sha256": {n: sha256_file(stage / n) for n in COMPARE_SIGNED}},
                        argv, stage="compare")
        publish_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if cfg.write_policy:  # asked for: each export gains its measured policy (recorded, as eval's reports are)
        report["policies"] = [str(p) for p in write_policies(report, candidates)]
    return report


REPORT_BYTES = 16 << 20  # report.json, compare.png and the serving configs: well under this


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
        draft = {"name": f"{manifest['algorithm']} {precision} ({d})", "export": str(d),
                 "method": manifest["method"], "precision": precision, "ns": list(range(1, most + 1)),
                 "config": {"method": manifest["method"], "model": str(Path(d).resolve())}, "proposer": proposer,
                 "weights_sha256": manifest["files"][formats.WEIGHTS]["sha256"],
                 "fp8": bool(manifest.get("quantization"))}
        out.append(draft)
        out += knob_candidates(cfg, draft, target)
    if cfg.ngram:
        ngram = NGramDraft(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        out.append({"name": f"ngram (n {ngram.min_n}..{ngram.max_n})", "export": None, "method": "ngram",
                    "precision": None, "ns": list(range(1, max(largest, 4) + 1)),
                    "config": ngram.speculative_config(), "proposer": ngram})
    return out


def knob_candidates(cfg: CompareConfig, draft: dict, target) -> list[dict]:
    """The draft once more per vLLM knob (trainer/serving.py KNOBS) that can change its serving here:
    served only where the installed vLLM has the knob (the runner says where not, in one line); a
    knob that changes only sampled serving only when compare samples (temperature > 0)."""
    if not cfg.vllm:
        return []
    out = []
    for field, k in serving.KNOBS.items():
        if k["sampled_only"] and cfg.temperature == 0:
            continue
        proposer = draft["proposer"]
        if field == "draft_sample_method":  # the in-tree decoder samples its draft as vLLM does
            proposer, _ = load_proposer(draft["export"], target, draft_sampling=k["value"])
        out.append({**draft, "name": f"{draft['name']} + {field}={json.dumps(k['value'])}",
                    "config": {**draft["config"], field: k["value"]}, "proposer": proposer,
                    "knob": {field: k["value"]}, "base": draft["name"], "in_tree_model": k["in_tree"]})
    return out


def knob_lines(cfg: CompareConfig, candidates) -> list[dict]:
    """Per draft and vLLM knob: served as a candidate of its own, or why not (one line each; none
    with --no-vllm, which serves nothing)."""
    rows = []
    if not cfg.vllm:
        return rows
    for c in candidates:
        if c["method"] == "ngram" or c.get("knob"):
            continue
        for field, k in serving.KNOBS.items():
            mine = next((x for x in candidates if x.get("base") == c["name"] and field in x["knob"]), None)
            if mine is not None:
                why = mine.get("unavailable") or mine.get("not_served")
                rows.append({"draft": c["name"], "knob": field, "value": k["value"],
                             "candidate": None if why else mine["name"], "unavailable": why})
                continue
            why = ("changes only sampled serving (at temperature 0 a draft token drawn from q is q's argmax and "
                   "greedy verification never reads q); compare served greedily: pass temperature=T > 0")
            rows.append({"draft": c["name"], "knob": field, "value": k["value"], "candidate": None,
                         "unavailable": why})
    return rows


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


def acceptance(target, proposer, prompts, max_new_tokens: int, n: int, temperature: float = 0.0) -> dict:
    """One candidate at N, decoded one prompt at a time (as `draftsmith eval` and vLLM count), greedy
    or sampled at `temperature` (prompt i seeded with i); per prompt its decoding steps and output
    tokens (what the serving simulation replays)."""
    stats, per_prompt = DecodeStats(n), []
    for i, prompt in enumerate(prompts):
        out, s = generate(target, [prompt], max_new_tokens, proposer, n, sampling=Sampling(temperature=temperature),
                          eos_token_ids=target.eos_token_ids, seed=i)
        stats.merge(s)
        per_prompt.append([s.iterations, len(out[0])])
    share = stats.rounds / stats.iterations if stats.iterations else 0.0
    return {"tau": stats.tau, "share": share, "tokens_per_step": 1.0 + share * (stats.tau - 1.0) if stats.rounds
            else 1.0, **stats.counts(), "steps": stats.iterations, "per_prompt": per_prompt}


def draft_round_seconds(target, proposer, prompts, n: int, b: int, steps: int) -> float:
    """The draft's time per round (propose and commit) over b rows at N, from a short batched
    decode of the prompts (repeated to fill b rows)."""
    rows = [prompts[i % len(prompts)] for i in range(b)]
    _, s = generate(target, rows, steps, proposer, n, eos_token_ids=())
    return s.draft_s / s.iterations if s.iterations else 0.0


def in_tree_costs(target, candidates, prompts, cfg) -> dict:
    """--no-vllm: the target's forward at b rows x width and each draft's round, timed in-tree;
    expected tokens/s (Leviathan et al., 2023, §3.4, the costs measured, not assumed):
    b x tokens per step / (share x (V(b, N+1) + D(b, N)) + (1 - share) x V(b, 1)); none: b / V(b, 1)."""
    context = context_for(prompts, cfg.max_new_tokens)
    widths = sorted({1} | {n + 1 for c in candidates for n in c["ns"]})
    verify_s = {b: serving.wider_costs_more({w: target_step_seconds(target, context, b, w) for w in widths})
                for b in cfg.concurrency}
    rows = [{"candidate": "no speculation", "n": 0, "concurrency": b, "tokens_per_s": b / verify_s[b][1]}
            for b in cfg.concurrency]
    for c in candidates:
        for n, m in c["by_n"].items():
            a = m["acceptance"]
            m["draft_s"] = {b: draft_round_seconds(target, c["proposer"], prompts, n, b, cfg.cost_steps)
                            for b in cfg.concurrency}
            for b in cfg.concurrency:
                seconds = a["share"] * (verify_s[b][n + 1] + m["draft_s"][b]) + (1 - a["share"]) * verify_s[b][1]
                rows.append({"candidate": c["name"], "n": n, "concurrency": b,
                             "tokens_per_s": b * a["tokens_per_step"] / seconds})
    return {"verify_s": verify_s, "predictions": rows}


def served_in_vllm(target, candidates, prompts, cfg) -> dict:
    """Every candidate and no speculation served in vLLM (greedy, fp32) on the prompts at every N
    and concurrency b, as a client keeping b requests in flight (trainer/vllm/runners/vllm_generate.py,
    a sweep: one engine per draft, N set through vLLM's dynamic speculative decoding), each engine
    step timed. From each (candidate, N): vLLM's step time with k requests in flight and its
    prompt cost per token, and so the prediction: the in-tree decoder's steps per prompt replayed
    through those costs (`simulate`). Measured beside it: the served output tokens/s, whether
    vLLM's counts equal the in-tree decoder's, and whether its outputs equal its plain decoding's."""
    dtype = serving_dtype(cfg, candidates)
    text = target.model.config.get_text_config()
    longest = max(len(p) for p in prompts) + cfg.max_new_tokens + max(n for c in candidates for n in c["ns"]) + 1
    if longest > text.max_position_embeddings:
        raise DraftsmithError(f"compare: the longest prompt ({max(len(p) for p in prompts)} tokens), "
                              f"{cfg.max_new_tokens} new tokens and the draft tokens need a {longest}-token context; "
                              f"{target.name} takes {text.max_position_embeddings}: lower --max-new-tokens or use "
                              "shorter prompts")
    longest = served_max_model_len(text, longest)
    work = Path(tempfile.mkdtemp(prefix="compare-", dir=ensure_dir(cache_root() / "work", "draftsmith's cache")))
    top = max(cfg.concurrency)
    sweep = {"concurrency": cfg.concurrency, "repeats": cfg.repeats, "warmup": True}
    jobs = [{"target": target.hf_dir, "prompts": prompts, "out": str(work / "none.json"), "max_num_seqs": top,
             "max_new_tokens": cfg.max_new_tokens, "sweep": {**sweep, "ns": [0]}, "dtype": dtype,
             "max_model_len": longest, "temperature": cfg.temperature}]  # no prompt cut by vLLM's 1,024
    for i, c in enumerate(candidates):
        job = {**jobs[0], "out": str(work / f"candidate-{i}.json"), "sweep": {**sweep, "ns": c["ns"]}}
        if c["method"] == "ngram":
            job.update(method="ngram", **{k: v for k, v in c["config"].items() if k.startswith("prompt_lookup")})
        else:
            job.update(draft=c["config"]["model"], method=c["method"], knobs=c.get("knob"))
        jobs.append(job)
    print(f"compare: serving {len(jobs)} engines in vLLM (every N, concurrency {cfg.concurrency}, {cfg.repeats} "
          "servings each after a warm-up)", file=sys.stderr)
    try:
        results = checks.run_vllm_jobs(jobs, timeout=900 * len(jobs))
    except BaseException:  # of the work folder (in draftsmith's cache) only the runner's log stays: the error names it
        for f in work.iterdir():
            if f.suffix != ".log":
                f.unlink()
        raise
    shutil.rmtree(work)
    plain = results[0]["sweep"]
    lengths = [len(p) for p in prompts]
    rows, served = [], {}
    # plain decoding: one step per token after the prompt's (its outputs are every candidate's, checked below)
    none_steps = [[len(o) - 1, len(o)] for o in plain[0]["outputs"]]
    rows += serving.predicted_and_measured("no speculation", 0, plain, none_steps, lengths)
    for c, r in zip(candidates, results[1:]):
        if "unservable" in r and c.get("knob"):  # a knob this vLLM lacks or refuses: said, not predicted
            c["unavailable"] = r["unservable"]
    unserved = [c for c, r in zip(candidates, results[1:]) if "unservable" in r and not c.get("knob")]
    for c, r in zip(candidates, results[1:]):
        if "unservable" in r:
            c["not_served"] = r["unservable"]
            continue
        for n in c["ns"]:
            mine = [row for row in r["sweep"] if row["n"] == n]
            a = c["by_n"][n]["acceptance"]
            rows += serving.predicted_and_measured(c["name"], n, mine, a["per_prompt"], lengths)
            c["by_n"][n]["vllm"] = [{"concurrency": row["concurrency"], "repeat": row.get("repeat", 0),
                                     "tokens_per_s": row["tokens"] / row["seconds"],
                                     "counts_equal": None if not c.get("in_tree_model", True) else
                                     same_counts(row["spec"], a, n) if not cfg.temperature else
                                     same_rates(mine[0]["spec"], a, n),
                                     "outputs_equal": None if cfg.temperature else
                                     row["outputs"] == plain[0]["outputs"]} for row in mine]
    if unserved:  # the in-tree decoder's costs, its speedup over its own plain decoding at vLLM's plain speed
        print(f"compare: {', '.join(c['name'] for c in unserved)}: {unserved[0]['not_served']}; predicted from "
              "in-tree costs", file=sys.stderr)
        costs = in_tree_costs(target, unserved, prompts, cfg)
        own_plain = {p["concurrency"]: p["tokens_per_s"] for p in costs["predictions"] if p["n"] == 0}
        vllm_plain = {p["concurrency"]: p["measured_tokens_per_s"] for p in rows if p["n"] == 0}
        for p in costs["predictions"]:
            if p["n"]:
                speedup = p["tokens_per_s"] / own_plain[p["concurrency"]]
                rows.append({**p, "in_tree": True, "speedup": speedup,
                             "at_vllm_plain_tokens_per_s": speedup * vllm_plain[p["concurrency"]]})
        served["in_tree_verify_s"] = costs["verify_s"]
    served["predictions"] = rows
    served["vllm_version"] = results[0]["vllm"]
    served["vllm_mode"] = mode = results[0].get("mode", {})
    served["vllm_dtype"] = mode.get("dtype", dtype)
    exclude_unfaithful(candidates, served["vllm_dtype"])
    return served


def exclude_unfaithful(candidates, dtype: str) -> None:
    """A candidate is recommended only when vLLM served it losslessly and as measured in-tree: in
    float32 any output that differs from vLLM's plain decoding, or counts that differ from the
    in-tree decoder's, exclude it (c["excluded"]: why, in one line). In bfloat16/float16 vLLM's
    own near-ties flip tokens (and the in-tree decoder runs float32): those are tolerated and
    counted (c["divergent_servings"])."""
    for c in candidates:
        servings = [(n, v) for n, m in c["by_n"].items() for v in m.get("vllm", [])]
        differ = [(n, v) for n, v in servings if v["outputs_equal"] is False]  # None: not checkable (sampled)
        miscount = [(n, v) for n, v in servings if v["counts_equal"] is False]  # None: no in-tree model
        c["divergent_servings"] = {"outputs": len(differ), "counts": len(miscount), "of": len(servings)}
        if dtype != "float32" or not (differ or miscount):
            continue
        n, v = (differ or miscount)[0]
        what = "its outputs differ from vLLM's plain decoding (not lossless)" if differ else \
            "vLLM's counts differ from the in-tree decoder's"
        c["excluded"] = f"{what} at N={n}, concurrency {v['concurrency']} ({len(differ)} output and {len(miscount)} " \
                        f"count mismatches in {len(servings)} float32 servings): never recommended"


def serving_dtype(cfg: CompareConfig, candidates) -> str:
    """One dtype for the target under every candidate (a speedup is one over the same target):
    bfloat16 where an FP8 export is compared (vLLM's Quark loader takes one only over a bf16/fp16
    target), else "deployed": the runner serves the target's own dtype on a GPU build and float32
    on vLLM's CPU build, where vLLM's counts are the in-tree decoder's exactly."""
    fp8 = [c["export"] for c in candidates if c.get("fp8")]
    if cfg.dtype == "float32" and fp8:
        raise DraftsmithError(f"compare dtype=float32 with the FP8 export '{fp8[0]}': vLLM serves an FP8 draft only "
                              "over a bfloat16 or float16 target; use dtype=bfloat16 (or auto)")
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if fp8 else "deployed"


def same_counts(vllm_spec: dict, ours: dict, n: int) -> bool:
    """vLLM's counters at N (an engine started for a larger N reports its other positions, at 0)
    equal the in-tree decoder's."""
    theirs = vllm_spec["accepted_per_position"]
    return (vllm_spec["num_drafts"], vllm_spec["num_accepted_tokens"]) == (ours["num_drafts"],
                                                                         ours["num_accepted_tokens"]) \
        and theirs[:n] == ours["accepted_per_position"] and not any(theirs[n:])


def same_rates(vllm_spec: dict, ours: dict, n: int) -> bool:
    """Sampled serving: vLLM's acceptance rate at each position agrees with the in-tree decoder's
    within 3 standard errors (trainer/metrics.py; the draws differ, so in distribution only). One
    serving per N: the repeats draw with the same seeds."""
    theirs = vllm_spec["accepted_per_position"]
    if not vllm_spec["num_drafts"] or not ours["num_drafts"]:
        return vllm_spec["num_drafts"] == ours["num_drafts"]
    return not any(theirs[n:]) and all(r["agree"] for r in sampled_acceptance_agreement(
        (theirs[:n], vllm_spec["num_drafts"]), (ours["accepted_per_position"], ours["num_drafts"])))


def write_policies(report: dict, candidates) -> list[Path]:
    """--write-policy: each export's serving policy into the export (export/policy.py), recorded."""
    written = []
    configs = {c["name"]: c["config"] for c in candidates}
    for c in candidates:
        if not c.get("export") or c.get("knob"):
            continue
        chosen = serving.draft_or_plain(c, report["concurrency"], candidates, report["predictions"], knobs=True)
        plain = {b: next(p for p in report["predictions"] if p["concurrency"] == b and p["n"] == 0)
                 for b in report["concurrency"]}
        # the one config for every load: that of the configuration chosen at the most loads (the draft's
        # own on a tie), its N per load as vLLM's schedule
        served = [row["candidate"] for row, _ in chosen.values() if row["n"]]
        most = max(sorted(set(served), key=lambda name: name != c["name"]), key=served.count) if served else c["name"]
        schedule = report["dynamic_configs"].get(most, {}).get("num_speculative_tokens_per_batch_size")
        knobs = [k for k in report.get("knobs", []) if k["draft"] == c["name"]]
        made = policy.build(report, c, {b: row for b, (row, _) in chosen.items()}, plain,
                            {b: why for b, (_, why) in chosen.items()}, schedule,
                            configs=configs, schedule_config=configs.get(most), knobs=knobs)
        made.update(policy.context_note(report, c["name"]))  # --context-buckets: its cut-off per load, or nothing
        written.append(policy.write(c["export"], made))
    return written


def by_context(cfg: CompareConfig, target, candidates) -> dict:
    """--context-buckets: every candidate measured as the comparison above (acceptance in-tree at
    every N, then served in vLLM, or in-tree costs with --no-vllm) on each bucket's own prompts
    (trainer/data/buckets.py: L - max_new_tokens tokens under the prompts' template), and per
    candidate and concurrency the context length above which serving without speculation is the
    choice (trainer/serving.py `speculation_cutoff`, on the candidate's fastest N per bucket)."""
    encode = prompt_encoder(target, cfg.drafts[0] if cfg.drafts else "ngram", cfg.chat_template, False,
                            "compare --chat-template")
    buckets = []
    for L in cfg.context_buckets:
        _, prompts = context_prompts(target.tokenizer, encode, L - cfg.max_new_tokens, cfg.num_prompts)
        print(f"compare: context bucket {L}: {len(prompts)} prompts of {len(prompts[0])} tokens", file=sys.stderr)
        mine = [{k: v for k, v in c.items() if k not in ("by_n", "excluded", "not_served", "divergent_servings")}
                for c in candidates]  # this bucket's measurement of each, the whole comparison's kept
        by_name = {c["name"]: c for c in mine}
        for c in mine:
            if c.get("knob") and not c.get("in_tree_model", True):  # as run(): its draft's in-tree counts
                c["by_n"] = {n: {"acceptance": m["acceptance"]} for n, m in by_name[c["base"]]["by_n"].items()}
                continue
            c["by_n"] = {n: {"acceptance": acceptance(target, c["proposer"], prompts, cfg.max_new_tokens, n,
                                                      cfg.temperature)} for n in c["ns"]}
        costs = served_in_vllm(target, mine, prompts, cfg) if cfg.vllm else in_tree_costs(target, mine, prompts, cfg)
        buckets.append({"context": L, "prompt_tokens": len(prompts[0]), "prompts": len(prompts),
                        "predictions": costs["predictions"], "candidates": [
                            {"name": c["name"], "excluded": c.get("excluded") or c.get("not_served"),
                             "by_n": {n: {k: m["acceptance"][k] for k in ("tau", "num_drafts", "num_accepted_tokens",
                                                                           "accepted_per_position")}
                                      for n, m in c["by_n"].items()}} for c in mine],
                        "_candidates": mine})
    cutoffs = []
    for c in candidates:
        for b in cfg.concurrency:
            rows = []
            for bucket in buckets:
                here = [p for p in serving.eligible(bucket["predictions"], bucket["_candidates"], b)
                        if p["candidate"] == c["name"]]
                if not here:  # excluded or not served at this bucket: no figure to decide on
                    continue
                best = max(here, key=lambda p: serving.spread(serving.runs_of(p))[0])
                plain = next(p for p in bucket["predictions"] if p["concurrency"] == b and p["n"] == 0)
                runs, plain_runs = serving.runs_of(best), serving.runs_of(plain)
                rows.append({"context": bucket["context"], "n": best["n"], "runs": runs, "plain_runs": plain_runs,
                             "tokens_per_s": serving.spread(runs)[0],
                             "plain_tokens_per_s": serving.spread(plain_runs)[0]})
            if rows:
                cutoffs.append({"candidate": c["name"], "concurrency": b, **serving.speculation_cutoff(rows),
                                "buckets": [{k: v for k, v in r.items() if not k.endswith("runs")} for r in rows]})
    for bucket in buckets:
        del bucket["_candidates"]
    return {"context_buckets": buckets, "context_cutoffs": cutoffs, "context_cutoff_in_vllm": policy.VLLM_CONTEXT}


def format_context(r: dict) -> list[str]:
    """--context-buckets: per candidate τ at its largest N per bucket, and per load its cut-off."""
    if not r.get("context_buckets"):
        return []
    rows = ["  per context length (" + ", ".join(f"{b['context']}: prompts of {b['prompt_tokens']} tokens"
                                              for b in r["context_buckets"]) + "):"]
    for i, c in enumerate(r["context_buckets"][0]["candidates"]):
        taus = [b["candidates"][i]["by_n"] for b in r["context_buckets"]]
        rows.append(f"    {c['name']}: τ at N={max(taus[0])} by context: " + ", ".join(
            f"{b['context']}: {t[max(t)]['tau']:.2f}" for b, t in zip(r["context_buckets"], taus)))
    for x in r["context_cutoffs"]:
        rows.append(f"    {x['candidate']} at concurrency {x['concurrency']}: " + (
            f"speculation pays up to {x['pays_up_to']} tokens of context" if x["pays_up_to"] else
            "speculation does not pay at the shortest bucket")
            + (f", serve without it from {x['plain_from']}" if x["plain_from"] else " (every bucket measured)")
            + " (" + ", ".join(f"{b['context']}: {b['tokens_per_s']:.1f} vs {b['plain_tokens_per_s']:.1f} tok/s"
                               for b in x["buckets"]) + ")")
    rows.append(f"    in vLLM: {r['context_cutoff_in_vllm']}")
    return rows


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def plot(report: dict, path: Path) -> None:
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    conc = report["concurrency"]
    measured = any("measured_tokens_per_s" in p for p in report["predictions"])
    for name in dict.fromkeys(p["candidate"] for p in report["predictions"]):
        mine = [p for p in report["predictions"] if p["candidate"] == name]
        key = "at_vllm_plain_tokens_per_s" if mine[0].get("in_tree") else \
            "measured_tokens_per_s" if measured else "tokens_per_s"
        best = [max(p[key] for p in mine if p["concurrency"] == b) for b in conc]
        ax.plot(conc, best, marker="o", linestyle="--" if mine[0].get("in_tree") else "-",
                label=name + (" (not served: in-tree speedup x vLLM plain)" if mine[0].get("in_tree") else ""))
    ax.set(xscale="log", xlabel="concurrency (requests in flight)",
           ylabel="output tokens/s, served in vLLM" if measured else "expected output tokens/s (in-tree costs)",
           xticks=conc, xticklabels=[str(b) for b in conc], title=f"{report['target']} on {report['dataset']}, "
                                                                  "each at its best N")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def format_report(r: dict) -> str:
    rows = [f"{r['target']} on {r['dataset']} ({r['prompts']} prompts, {r['max_new_tokens']} tokens each); costs "
            f"measured in {r['costs_measured_in']}"]
    if r.get("vllm_mode"):
        rows.append(f"  served as: {served_as(r)}")
    if r.get("temperature"):
        rows.append(f"  sampled at temperature {r['temperature']} (vLLM seeds request i with i): outputs are not "
                    "compared token for token, vLLM's acceptance per position is held to the in-tree decoder's "
                    "within 3 standard errors")
    for k in r.get("knobs", []):
        if k["unavailable"]:
            rows.append(f"  vLLM knob {k['knob']}={json.dumps(k['value'])} for {k['draft']}: unavailable: "
                        f"{k['unavailable']}")
    for c in r["candidates"]:
        if c.get("knob") and not c.get("in_tree_model", True):
            rows.append(f"  {c['name']}: served as a candidate of its own; the in-tree decoder has no "
                        f"{next(iter(c['knob']))}: its prediction replays the draft's own in-tree steps, "
                        "its outputs are checked, its counts are not")
            continue
        taus = ", ".join(f"N={n}: τ {m['acceptance']['tau']:.2f}" + (f" in {m['acceptance']['share']:.0%} of steps"
                                                                     if m["acceptance"]["share"] < 1 else "")
                         for n, m in c["by_n"].items())
        rows.append(f"  {c['name']}: {taus}")
        if c.get("not_served"):
            rows.append(f"    not served: {c['not_served']} (its costs from the in-tree decoder; never "
                        "recommended here)")
        if c.get("excluded"):
            rows.append(f"    excluded: {c['excluded']}")
        elif (c.get("divergent_servings") or {}).get("outputs") or (c.get("divergent_servings") or {}).get("counts"):
            d = c["divergent_servings"]
            rows.append(f"    note: served in {r.get('vllm_dtype')}, {d['outputs']} of {d['of']} servings had outputs "
                        f"that differ from plain decoding's and {d['counts']} counts that differ from the float32 "
                        "in-tree decoder's (near-ties outside float32: tolerated, counted)")
    for b, rec in r["recommendations"].items():
        rows.append(f"  concurrency {b}:")
        here = [p for p in r["predictions"] if p["concurrency"] == b]
        unserved = {}  # a candidate this vLLM cannot serve: its best N only
        for p in here:
            if p.get("in_tree") and p["speedup"] > unserved.get(p["candidate"], {"speedup": -1})["speedup"]:
                unserved[p["candidate"]] = p
        here = [p for p in here if not p.get("in_tree")] + list(unserved.values())
        for p in sorted(here,
                        key=lambda p: -p.get("measured_tokens_per_s", p.get("at_vllm_plain_tokens_per_s",
                                                                                 p["tokens_per_s"]))):
            name = p["candidate"] + (f" N={p['n']}" if p["n"] else "")
            served = f"predicted {p['tokens_per_s']:7.1f} tok/s"
            if p.get("in_tree"):
                served = (f"not served, in-tree {p['speedup']:.2f}x its plain decoding "
                          f"(~{p['at_vllm_plain_tokens_per_s']:.1f} tok/s at vLLM's plain speed)")
            elif "measured_tokens_per_s" in p:
                served = (f"served {p['measured_tokens_per_s']:7.1f} ± {p.get('measured_se', 0):4.1f} tok/s, {served} "
                          f"({p['error']:+.0%})")
            rows.append(f"    {served}  {name}")
        best = rec["best"]
        rows.append("    serve: " + (f"--speculative-config '{json.dumps(best['config'])}'" if best["config"]
                                      else "without speculation") + f" ({rec.get('why', 'the fastest')})")
    rows += format_context(r)
    return "\n".join(rows)


def served_as(r: dict) -> str:
    """How vLLM served every figure: its version, eager or graphs, where its engine core ran, the
    target's dtype, the repeats (the report's and the model card's line)."""
    m = r.get("vllm_mode") or {}
    return (f"vLLM {r.get('vllm_version')} on {m.get('platform', '?')}, "
            f"{'eager' if m.get('enforce_eager') else 'CUDA graphs'}, engine core {m.get('engine_core', '?')}, "
            f"target in {r.get('vllm_dtype')}, {r.get('repeats', 1)} servings per cell after a discarded warm-up "
            "(± one standard error)")


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
        if argv[i] in ("--concurrency", "--context-buckets") and i + 1 < len(argv) and not argv[i + 1].startswith("["):
            out += [argv[i], f"[{argv[i + 1]}]"]
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
    print(f"  written to {cfg.output_dir}/report.json, compare.png, serve-c*.json (one configuration per load) and "
          "serve-dynamic.json (per draft, its best N at each load as vLLM's batch-size schedule)")


if __name__ == "__main__":
    main()
