"""An export's serving policy: what `draftsmith compare --write-policy` measured for it, shipped
inside the export (`serving/policy.json`, recorded in its manifest's `added_files` as eval's
reports are, so upload checks it and puts it in the model card), and the `vllm serve` line it
gives for a stated load (`draftsmith serve-line EXPORT --concurrency B`).

    {"format": FORMAT, "weights_sha256": the export's weights it was measured with,
     "measured": {"vllm", "mode" (platform, eager or graphs, engine core, dtype), "dtype", "machine",
                  "dataset", "prompts", "max_new_tokens", "repeats", "rule"},
     "loads": [{"concurrency", "serve": --speculative-config or null (without speculation),
                "tokens_per_s", "se", "plain_tokens_per_s", "plain_se", "why"}, ...],
     "schedule": vLLM's num_speculative_tokens_per_batch_size (ranges from 1) or null,
     "excluded": why it is never served (unfaithful, or not servable here), or null}

Each load's choice is this draft against serving without speculation only (trainer/serving.py's
rule: the simpler one unless the other is faster beyond the noise); which draft to serve among
several is compare's report.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from export import formats
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json, ensure_dir, sha256_file

FORMAT = "draftsmith-serving-policy-v1"
POLICY = "serving/policy.json"


def build(report: dict, candidate: dict, choices: dict[int, dict], plain: dict[int, dict], why: dict[int, str],
          schedule: list | None) -> dict:
    """The policy of one compared export: per load the chosen row (this draft at N, or plain
    decoding: n 0), plain decoding's row beside it, and the reason."""
    loads = []
    for b in sorted(choices):
        row, base = choices[b], plain[b]
        serve = None if row["n"] == 0 else {**candidate["config"], "num_speculative_tokens": row["n"]}
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
                         "served": all("measured_tokens_per_s" in r for r in choices.values()),
                         "rule": "the simpler of this draft and plain decoding unless the other is faster by >= 2% "
                                 "and a one-sided Welch t-test at 97.5% (trainer/serving.py)"},
            "loads": loads, "schedule": schedule, "excluded": candidate.get("excluded") or candidate.get("not_served")}


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
             f"{m['max_new_tokens']} tokens. Rule: {m['rule']}.", ""]
    if policy.get("excluded"):
        return lines + [f"Not to be served: {policy['excluded']}.", ""]
    lines += ["| concurrency | serve | tokens/s | without speculation |", "|---|---|---|---|"]
    for x in policy["loads"]:
        what = f"N={x['serve']['num_speculative_tokens']}" if x["serve"] else "without speculation"
        lines.append(f"| {x['concurrency']} | {what} | {x['tokens_per_s']:.1f} ± {x['se']:.1f} | "
                     f"{x['plain_tokens_per_s']:.1f} ± {x['plain_se']:.1f} |")
    if policy.get("schedule"):
        lines += ["", f"One config for every load (vLLM's dynamic speculative decoding): "
                      f"`\"num_speculative_tokens_per_batch_size\": {json.dumps(policy['schedule'])}`"]
    return lines + [""]
