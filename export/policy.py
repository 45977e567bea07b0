"""An export's serving policy: what `draftsmith compare --write-policy` measured for it, shipped
inside the export (`serving/policy.json`, recorded in its manifest's `added_files` as eval's
reports are, so upload checks it and puts it in the model card), and the `vllm serve` line it
gives for a stated load (`draftsmith serve-line EXPORT --concurrency B`).

    {"format": FORMAT, "weights_sha256": the export's weights it was measured with,
     "measured": {"vllm", "mode" (platform, eager or graphs, engine core, dtype), "dtype", "machine",
                  "dataset", "prompts", "max_new_tokens", "temperature", "repeats", "rule"},
     "loads": [{"concurrency", "serve": --speculative-config or null (without speculation),
                "tokens_per_s", "se", "plain_tokens_per_s", "plain_se", "why"}, ...],
     "schedule": vLLM's num_speculative_tokens_per_batch_size (ranges from 1) or null,
     "schedule_config": the --speculative-config the schedule goes in (the configuration chosen at the
                        most loads: the draft's own, or with a vLLM knob) or null,
     "knobs": per vLLM knob (trainer/serving.py KNOBS): the candidate it was served as, or why it was
              unavailable (the installed vLLM lacks it, would ignore it, or refused it),
     "excluded": why it is never served (unfaithful, or not servable here), or null}

Each load's choice is this draft (alone, or with each vLLM knob that was served) against serving
without speculation only (trainer/serving.py's rule: the simpler one unless the other is faster
beyond the noise; a knob is the less simple); which draft to serve among several is compare's report.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from export import formats
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json, ensure_dir, sha256_file
from trainer.serving import KNOBS

FORMAT = "draftsmith-serving-policy-v1"
POLICY = "serving/policy.json"
# Where vLLM could act on a context cut-off (`compare --context-buckets`): read in the installed
# vLLMs' vllm/config/speculative.py and vllm/config/vllm.py. SpeculativeConfig.max_model_len ("used
# when testing the ability to skip speculation for some sequences") only sizes the draft: 0.32's v1
# runner never reads it again (it drafts up to the target's max_model_len), and 0.34 lowers the whole
# server's max_model_len to it (VllmConfig._limit_max_model_len_to_draft: "the model runner can't skip
# speculation for longer sequences"), so longer requests are refused, not served without a draft.
VLLM_CONTEXT = ("no setting of vLLM 0.32 or 0.34 turns drafting off above a context length (the speculative "
                "config's max_model_len sizes the draft only: 0.32 drafts up to the target's --max-model-len "
                "regardless, 0.34 lowers the server's --max-model-len to it and refuses longer requests): route "
                "requests longer than the cut-off to a server without --speculative-config")


def context_note(report: dict, candidate: str, concurrency: int | None = None) -> dict:
    """What `compare --context-buckets` measured of `candidate`'s context cut-off: for the serving
    policy (every load) {"context": {"cutoffs": [...], "in_vllm": VLLM_CONTEXT}}, or for one load's
    serving config {"context_cutoff": {...}}; {} without buckets (or for plain decoding)."""
    mine = [x for x in report.get("context_cutoffs") or [] if x["candidate"] == candidate
            and concurrency in (None, x["concurrency"])]
    if not mine:
        return {}
    keep = ("concurrency", "pays_up_to", "plain_from", "regained", "buckets")
    if concurrency is None:
        return {"context": {"buckets": [b["context"] for b in report["context_buckets"]],
                            "cutoffs": [{k: x[k] for k in keep} for x in mine], "in_vllm": VLLM_CONTEXT}}
    return {"context_cutoff": {**{k: mine[0][k] for k in keep if k != "buckets"}, "in_vllm": VLLM_CONTEXT}}


def context_card_lines(policy: dict) -> list[str]:
    """The model card's context-length section: per load, tokens/s by context with and without
    speculation and the length above which serving without it is the choice."""
    ctx = policy.get("context")
    if not ctx:
        return []
    lines = ["", "### Context length", "",
             "| concurrency | " + " | ".join(f"{L} tokens" for L in ctx["buckets"])
             + " | serve without speculation above |", "|---|" + "---|" * (len(ctx["buckets"]) + 1)]
    for x in ctx["cutoffs"]:
        at = {b["context"]: b for b in x["buckets"]}
        cells = [f"{at[L]['tokens_per_s']:.1f} vs {at[L]['plain_tokens_per_s']:.1f}" if L in at else "-"
                 for L in ctx["buckets"]]
        cut = (f"{x['pays_up_to']} tokens" if x["pays_up_to"] else "every length measured") if x["plain_from"] \
            else f"none up to {ctx['buckets'][-1]} tokens"
        lines.append(f"| {x['concurrency']} | " + " | ".join(cells) + f" | {cut} |")
    return lines + ["", "Tokens/s with this draft vs without speculation, per context length (prompts of L minus "
                        f"the answer's tokens). {ctx['in_vllm'][0].upper()}{ctx['in_vllm'][1:]}."]


def build(report: dict, candidate: dict, choices: dict[int, dict], plain: dict[int, dict], why: dict[int, str],
          schedule: list | None, configs: dict[str, dict] | None = None, schedule_config: dict | None = None,
          knobs: list[dict] | None = None) -> dict:
    """The policy of one compared export: per load the chosen row (this draft at N, with a vLLM knob
    where one was chosen: `configs` by candidate name, or plain decoding: n 0), plain decoding's row
    beside it, and the reason."""
    configs = configs or {candidate["name"]: candidate["config"]}
    loads = []
    for b in sorted(choices):
        row, base = choices[b], plain[b]
        serve = None if row["n"] == 0 else {**configs[row["candidate"]], "num_speculative_tokens": row["n"]}
        loads.append({"concurrency": b, "serve": serve,
                      "tokens_per_s": row.get("measured_tokens_per_s", row["tokens_per_s"]),
                      "se": row.get("measured_se", 0.0),
                      "plain_tokens_per_s": base.get("measured_tokens_per_s", base["tokens_per_s"]),
                      "plain_se": base.get("measured_se", 0.0), "why": why[b]})
    return {"format": FORMAT, "weights_sha256": candidate["weights_sha256"],
            "measured": {"vllm": report.get("vllm_version"), "mode": report.get("vllm_mode"),
                         "dtype": report.get("vllm_dtype"), "machine": report.get("machine"),
                         "dataset": report["dataset"], "prompts": report["prompts"],
                         "max_new_tokens": report["max_new_tokens"], "repeats": report.get("repeats"),
                         "temperature": report.get("temperature", 0.0),
                         "served": all("measured_tokens_per_s" in r for r in choices.values()),
                         "rule": "the simpler of this draft and plain decoding unless the other is faster by >= 2% "
                                 "and a one-sided Welch t-test at 97.5% (trainer/serving.py)"},
            "loads": loads, "schedule": schedule, "schedule_config": schedule_config if schedule else None,
            "knobs": knobs or [], "excluded": candidate.get("excluded") or candidate.get("not_served")}


def write(export_dir: str | Path, policy: dict) -> Path:
    """serving/policy.json into the export, recorded in its manifest (upload then trusts it)."""
    root = Path(export_dir)
    path = ensure_dir(root / "serving", "the export's serving folder") / "policy.json"
    atomic_write_json(path, policy)
    formats.record_added_files(root, [path])
    return path


def read(export_dir: str | Path) -> dict | None:
    """The export's recorded policy, checked (its sha256 as recorded, measured with these weights),
    or None where it has none."""
    root = Path(export_dir)
    path = root / POLICY
    if not path.is_file():
        return None
    manifest = json.loads((root / formats.EXPORT_MANIFEST).read_text())
    recorded = (manifest.get("added_files") or {}).get(POLICY)
    if recorded is None or sha256_file(path) != recorded["sha256"]:
        raise DraftsmithError(f"{path} is not the policy `draftsmith compare --write-policy` recorded in "
                              f"{formats.EXPORT_MANIFEST} (edited after it was measured?); run compare again")
    policy = json.loads(path.read_text())
    if policy.get("format") != FORMAT or policy.get("weights_sha256") != manifest["files"][formats.WEIGHTS]["sha256"]:
        raise DraftsmithError(f"{path} was measured with other weights or is another format; run compare again")
    return policy


def load_for(policy: dict, concurrency: int) -> dict:
    """The measured load a concurrency falls under: the largest measured at or below it, else the smallest."""
    loads = sorted(policy["loads"], key=lambda x: x["concurrency"])
    below = [x for x in loads if x["concurrency"] <= concurrency]
    return below[-1] if below else loads[0]


def serve_line(policy: dict, manifest: dict, concurrency: int, target_ref: str | None = None) -> str:
    """The `vllm serve` line for `concurrency` requests in flight, as the policy measured it: the
    target (its local folder unless `target_ref` names it), the dtype it was measured in, and the
    --speculative-config (none where plain decoding was not beaten)."""
    at = load_for(policy, concurrency)
    target = target_ref or manifest["target"].get("hf_dir") or manifest["target"]["name"]
    parts = ["vllm", "serve", target]
    dtype = policy["measured"].get("dtype")
    if dtype and dtype not in ("auto", "deployed"):
        parts += ["--dtype", dtype]
    if manifest.get("serve_max_model_len"):
        parts += ["--max-model-len", str(manifest["serve_max_model_len"])]
    if at["serve"] is not None and not policy.get("excluded"):
        parts += ["--speculative-config", json.dumps(at["serve"])]
    return " ".join(shlex.quote(p) for p in parts)


def card_lines(policy: dict) -> list[str]:
    """The model card's section: per load what to serve, measured how."""
    m = policy["measured"]
    mode = m.get("mode") or {}
    lines = ["## Serving policy", "",
             f"Measured by `draftsmith compare` in vLLM {m.get('vllm')} on {mode.get('platform', '?')} "
             f"({'eager' if mode.get('enforce_eager') else 'CUDA graphs'}, the target in {m.get('dtype')}, "
             f"{m.get('repeats') or 1} servings per cell), {m['dataset']}, {m['prompts']} prompts x "
             f"{m['max_new_tokens']} tokens, " + (f"sampled at temperature {m['temperature']}" if m.get("temperature")
                                                   else "greedy") + f". Rule: {m['rule']}.", ""]
    if policy.get("excluded"):
        return lines + [f"Not to be served: {policy['excluded']}.", ""]
    lines += ["| concurrency | serve | tokens/s | without speculation |", "|---|---|---|---|"]
    for x in policy["loads"]:
        extra = {k: v for k, v in (x["serve"] or {}).items() if k in KNOBS}
        what = f"N={x['serve']['num_speculative_tokens']}" + "".join(f", {k}={json.dumps(v)}" for k, v in
                                                                     extra.items()) if x["serve"] else \
            "without speculation"
        lines.append(f"| {x['concurrency']} | {what} | {x['tokens_per_s']:.1f} ± {x['se']:.1f} | "
                     f"{x['plain_tokens_per_s']:.1f} ± {x['plain_se']:.1f} |")
    if policy.get("schedule"):
        lines += ["", f"One config for every load (vLLM's dynamic speculative decoding): "
                      f"`\"num_speculative_tokens_per_batch_size\": {json.dumps(policy['schedule'])}`"]
    for k in policy.get("knobs") or []:
        lines += ["", f"vLLM's {k['knob']}={json.dumps(k['value'])}: " + (f"unavailable ({k['unavailable']})"
                                                                          if k["unavailable"] else
                                                                          "measured as a candidate of its own")]
    return lines + context_card_lines(policy) + [""]
