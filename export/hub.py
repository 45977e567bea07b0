"""Publish an export to the Hugging Face Hub with a model card that carries its numbers.

The plan (`plan_upload`) is computed offline: which files, their sizes and sha256, and
the README.md model card (huggingface_hub's ModelCard / ModelCardData). `--dry-run`
prints it and stops. A real upload is one commit through huggingface_hub's commit API
(`create_repo` + `create_commit` of exactly the planned files). The token comes from
huggingface_hub (`HF_TOKEN` or the login cache) and is never printed, logged or written.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import HfHubHTTPError

from export import formats, policy
from trainer.errors import DraftsmithError
from trainer.io import sha256_file

REQUIRED = ("config.json", formats.WEIGHTS, formats.EXPORT_MANIFEST, "eval/report.json")
# Names and contents that look like credentials: refuse rather than publish them.
SECRET_NAMES = re.compile(r"(^|/)(\.env(\..*)?|\.netrc|\.npmrc|\.pypirc|credentials(\.json)?|id_(rsa|ed25519|ecdsa)"
                          r"|.*\.(pem|key|p12|pfx)|.*token.*|.*secret.*)$", re.IGNORECASE)
SECRET_CONTENT = re.compile(rb"hf_[A-Za-z0-9]{30,}|-----BEGIN [A-Z ]*PRIVATE KEY-----|AKIA[0-9A-Z]{16}"
                            rb"|ghp_[A-Za-z0-9]{36}|sk-[A-Za-z0-9_-]{32,}")
# huggingface_hub's HTTP stack raises its transport's own errors (httpx or its httpx2 fork, requests)
TRANSPORT_MODULES = ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")
TEXT_SCAN_LIMIT = 4 << 20  # bytes of each non-weight file scanned for secret patterns


@dataclass
class PlannedFile:
    path: str  # in the repo
    local: Path
    bytes: int
    sha256: str


@dataclass
class UploadPlan:
    export_dir: Path
    files: list[PlannedFile]
    card: str  # README.md
    manifest: dict

    def describe(self) -> str:
        rows = [f"{f.bytes:>12,}  {f.sha256}  {f.path}" for f in self.files]
        total = sum(f.bytes for f in self.files) + len(self.card.encode())
        return "\n".join([*rows, f"{len(self.card.encode()):>12,}  {'(generated model card)':<64}  README.md",
                          f"{total:>12,}  bytes in {len(self.files) + 1} files"])


def check_export(export_dir: str | Path, allow_extra: bool = False) -> tuple[dict, list[PlannedFile]]:
    """A complete, untampered draftsmith export with nothing in it that should not leave: every
    file the export wrote and every report `draftsmith eval` recorded into it (`added_files`)
    matches its sha256; a file neither wrote is refused unless `allow_extra` (it would be
    uploaded unseen)."""
    root = Path(export_dir)
    if not root.is_dir():
        raise DraftsmithError(f"'{root}' is not a folder; pass the output_dir of `draftsmith export`")
    for name in REQUIRED:
        if not (root / name).is_file():
            hint = ("run `draftsmith eval --draft EXPORT --output-dir EXPORT/eval`" if name.startswith("eval/")
                    else "export the draft again with `draftsmith export`")
            raise DraftsmithError(f"'{root}' is not a complete draftsmith export: {name} is missing; {hint}")
    try:
        manifest = json.loads((root / formats.EXPORT_MANIFEST).read_text())
        manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise DraftsmithError(f"{root / formats.EXPORT_MANIFEST} is not a complete export manifest; export again") \
            from None
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise DraftsmithError(f"'{root}/{rel}' is a symlink; an upload takes only regular files inside "
                                      "the export (copy the file in, or remove the link)")
            if name in filenames:
                if not p.resolve().is_relative_to(root.resolve()):
                    raise DraftsmithError(f"'{root}/{rel}' resolves outside the export")
                if SECRET_NAMES.search(rel):
                    raise DraftsmithError(f"'{root}/{rel}' looks like a credential file; remove it from the export")
                if p.suffix != ".safetensors":
                    with open(p, "rb") as f:
                        if SECRET_CONTENT.search(f.read(TEXT_SCAN_LIMIT)):
                            raise DraftsmithError(f"'{root}/{rel}' contains what looks like a secret (token or "
                                                  "private key); remove it from the export")
                files.append(PlannedFile(rel, p, p.stat().st_size, sha256_file(p)))
    by_path = {f.path: f for f in files}
    for name, info in manifest["files"].items():
        f = by_path.get(name)
        if f is None or f.sha256 != info["sha256"]:
            raise DraftsmithError(f"'{root}/{name}' does not match {formats.EXPORT_MANIFEST} (changed after export?); "
                                  "export again")
    added = manifest.get("added_files", {})
    for name, info in added.items():
        f = by_path.get(name)
        if f is None or f.sha256 != info["sha256"]:
            raise DraftsmithError(f"'{root}/{name}' does not match the sha256 `draftsmith eval` recorded for it "
                                  "(edited after the measurement?); measure again with `draftsmith eval --draft "
                                  f"{root} --output-dir {root}/{Path(name).parent}`")
    for p in root.glob("eval*/report.json"):  # the card is built only from recorded reports
        rel = p.relative_to(root).as_posix()
        if rel not in added:
            raise DraftsmithError(f"'{root}/{rel}' was not written by `draftsmith eval` of this export (no sha256 in "
                                  f"{formats.EXPORT_MANIFEST}); measure again with `draftsmith eval --draft {root} "
                                  f"--output-dir {root}/{p.parent.name}`")
    extra = sorted(set(by_path) - set(manifest["files"]) - set(added) - {formats.EXPORT_MANIFEST})
    if extra and not allow_extra:
        raise DraftsmithError(f"'{root}' holds files added after export: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''}; remove them or pass --allow-extra-files to "
                              "upload them too")
    if "README.md" in by_path:
        raise DraftsmithError(f"'{root}/README.md' exists; the model card is generated, remove it")
    formats.check_export_weights(root)  # a sha256 vouches for the file, not that it holds numbers
    return manifest, sorted(files, key=lambda f: f.path)


def _reports(root: Path) -> list[dict]:
    out = []
    for p in sorted(root.glob("eval*/report.json")):
        r = json.loads(p.read_text())
        r["_dir"] = p.parent.relative_to(root).as_posix()
        out.append(r)
    return out


COMPARE_PLOT = "compare/compare.png"  # where the comparison's plot goes in the repo
COMPARE_SIGNED = ("report.json", "compare.png")  # their sha256 in the comparison's provenance.json (compare.py)


def compared(manifest: dict, compare_dir: str | Path) -> tuple[dict, dict]:
    """The `draftsmith compare` report at compare_dir and this export's candidate in it (matched
    by its weights' sha256, so a report of another export, or of these weights before a re-export,
    is refused in one line)."""
    folder = Path(compare_dir).expanduser()
    path = folder / "report.json"
    if not path.is_file():
        raise DraftsmithError(f"--compare {compare_dir}: no `draftsmith compare` report there ({path}); run "
                              "`draftsmith compare --drafts EXPORT --output-dir DIR` and pass that DIR")
    try:
        signed = json.loads((folder / "provenance.json").read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        signed = None
    if not isinstance(signed, dict) or not all(isinstance(signed.get(n), str) for n in COMPARE_SIGNED):
        raise DraftsmithError(f"--compare {compare_dir}: its provenance.json records no sha256 of "
                              f"{' and '.join(COMPARE_SIGNED)} (an older or hand-made comparison); run `draftsmith "
                              "compare` again and pass its folder")
    for name in COMPARE_SIGNED:
        if not (folder / name).is_file() or sha256_file(folder / name) != signed[name]:
            raise DraftsmithError(f"--compare {compare_dir}: {name} does not match the sha256 `draftsmith compare` "
                                  "recorded for it (changed after it was measured?); run `draftsmith compare` again")
    try:
        report = json.loads(path.read_text())
        candidates = report["candidates"]
    except (ValueError, KeyError, TypeError) as err:
        raise DraftsmithError(f"--compare {compare_dir}: {path} is not a readable `draftsmith compare` report "
                              f"({type(err).__name__}: {err}); run `draftsmith compare` again") from None
    sha = manifest["files"][formats.WEIGHTS]["sha256"]
    mine = next((c for c in candidates if c.get("weights_sha256") == sha), None)
    if mine is None:
        names = ", ".join(c["name"] for c in candidates if c.get("export")) or "no export"
        raise DraftsmithError(f"--compare {compare_dir}: that comparison did not measure these weights (sha256 "
                              f"{sha[:16]}; it measured {names}); run `draftsmith compare` with this export")
    return report, mine


def compare_lines(report: dict, mine: dict, plot: bool) -> list[str]:
    """The card's section from a comparison: per concurrency, plain decoding, this draft at its best
    N and the best of everything compared, as served (or, with --no-vllm, predicted)."""
    served = any("measured_tokens_per_s" in p for p in report["predictions"])
    key = "measured_tokens_per_s" if served else "tokens_per_s"
    m = report["machine"]
    where = m.get("cuda") or f"{m['cpu']} CPU, {m['threads']} threads"
    mode = report.get("vllm_mode") or {}
    how = (f"served in vLLM {report.get('vllm_version')} ({'eager' if mode.get('enforce_eager') else 'CUDA graphs'}, "
           f"engine core {mode.get('engine_core', 'in-process')}, the target in {report.get('vllm_dtype', 'float32')}; "
           f"{report.get('repeats') or 1} servings per cell after a discarded warm-up, mean ± one standard error)"
           if served else
           "predicted from in-tree costs (`--no-vllm`: not served)")
    lines = ["## Served speed", "",
             f"Output tokens/s {how} on {where}, measured by `draftsmith compare`: {report['dataset']}, "
             f"{report['prompts']} prompts, {report['max_new_tokens']} tokens each, greedy, at each concurrency "
             "a client keeping that many requests in flight. \"Serve\" is the simplest configuration no other "
             "beats beyond the noise (a one-sided Welch t-test at 97.5% and at least 2%).", "",
             "| concurrency | without speculation | this draft (best N) | speedup | serve |",
             "|---|---|---|---|---|"]

    def cell(p: dict) -> str:
        return f"{p[key]:.1f}" + (f" ± {p['measured_se']:.1f}" if p.get("measured_se") else "")

    recommended = {int(b): r for b, r in (report.get("recommendations") or {}).items()}
    for b in report["concurrency"]:
        rows = [p for p in report["predictions"] if p["concurrency"] == b]
        plain_row = next(p for p in rows if p["n"] == 0)
        plain = plain_row[key]
        best = (recommended.get(b) or {}).get("best") or max((p for p in rows if not p.get("in_tree")),
                                                              key=lambda p: p[key])
        who = "this draft" if best["candidate"] == mine["name"] else best["candidate"]
        best_cell = "without speculation" if not best["n"] else f"{who}, N={best['n']}"
        mine_rows = [p for p in rows if p["candidate"] == mine["name"]]
        if mine_rows[0].get("in_tree"):  # the vLLM it was compared in cannot serve it
            top = max(mine_rows, key=lambda p: p["speedup"])
            lines.append(f"| {b} | {cell(plain_row)} | N={top['n']}: ~{top['at_vllm_plain_tokens_per_s']:.1f} (not "
                         f"served: in-tree costs) | {top['speedup']:.2f}x | {best_cell} |")
            continue
        top = max(mine_rows, key=lambda p: p[key])
        lines.append(f"| {b} | {cell(plain_row)} | N={top['n']}: {cell(top)} | {top[key] / plain:.2f}x | {best_cell} |")
    lines.append("")
    if plot:
        lines += [f"![output tokens/s against concurrency]({COMPARE_PLOT})", ""]
    return lines


def context_lines(r: dict) -> list[str]:
    """An eval report's τ, acceptance and in-tree tokens/s per context bucket, as a card table."""
    if not r.get("context_buckets"):
        return []
    k = r["num_draft_tokens"]
    cut = r["context_cutoff"]
    return ["### τ per context length", "",
            f"{r['context_buckets'][0]['prompts']} prompts per context length L (L - {r['max_new_tokens']} prompt "
            f"tokens: documents and a question from ShareGPT), N={k}, in-tree on the machine that measured it:", "",
            "| context | τ | " + " | ".join(f"acc@{i}" for i in range(1, k + 1)) + " | tokens/s | without "
            "speculation | speedup |", "|" + "---|" * (k + 5)] + [
        f"| {b['context']} | {b['tau']:.3f} | " + " | ".join(f"{a:.3f}" for a in b["conditional_acceptance"])
        + f" | {b['tokens_per_s']:.1f} | {b['plain_tokens_per_s']:.1f} | {b['speedup']:.2f}x |"
        for b in r["context_buckets"]] + [
        "", (f"In-tree, speculation paid up to {cut['pays_up_to']} tokens of context" if cut["pays_up_to"] else
             "In-tree, speculation did not pay at the shortest context measured")
        + (f"; above it serve without speculation (from {cut['plain_from']} tokens plain decoding was faster)."
           if cut["plain_from"] else " (at every context measured).")
        + f" In vLLM: {policy.VLLM_CONTEXT}.", ""]


def build_card(root: Path, manifest: dict, repo_id: str, base_model: str | None = None,
               comparison: tuple[dict, dict, bool] | None = None) -> str:
    target = dict(manifest["target"])
    target["name"] = base_model or target["name"]
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", target["name"]):
        raise DraftsmithError(f"the target '{target['name']}' is not a Hub repo id, so the card cannot name its "
                              "base_model; pass --base-model OWNER/NAME")
    quant = manifest.get("quantization")
    tags = ["speculative-decoding", manifest["method"], "vllm", "rocm", "draftsmith"]
    if quant:
        tags += ["fp8", "quark"]
    data = ModelCardData(base_model=target["name"], library_name="vllm", tags=tags,
                         license=target.get("license") or None, pipeline_tag="text-generation")
    reports = _reports(root)
    train_report = json.loads((root / "train_report.json").read_text()) if (root / "train_report.json").is_file() \
        else None
    prov = json.loads((root / "provenance.json").read_text()) if (root / "provenance.json").is_file() else {}
    best = reports[0]["best_num_draft_tokens"]["best_n"] if reports else None
    n = best or manifest["num_draft_tokens"]
    serve = formats.serve_command(target["name"], repo_id, n, manifest["method"], manifest.get("serve_max_model_len"))
    ex = formats.exporter(manifest["algorithm"])
    kind = (f"FP8 ({quant['scheme']}: per-channel FP8 weights, dynamic per-token FP8 activations; "
            f"{', '.join(quant['keep_bf16'])}, norms and the shared embedding in BF16, "
            "made with AMD Quark)" if quant else manifest["dtype"].upper())

    lines = [f"# {repo_id.split('/')[-1]}", "",
             f"An **{ex.TITLE}** for [{target['name']}](https://huggingface.co/{target['name']}), "
             f"for lossless speculative decoding in vLLM. Weights: {kind}.", "",
             *ex.describe(manifest),
             "", "## Serve it", "",
             *([f"Stock vLLM gives {target['name']}'s class no aux hidden states; install draftsmith's vLLM plugin "
                "into the vLLM environment first (`pip install trainer/vllm/plugin` from a draftsmith checkout, "
                "with that environment's pip), as the export was checked with:", ""]
               if "with draftsmith's vLLM plugin" in (manifest.get("servable") or {}).get("line", "") else []),
             "```bash", serve, "```", "",
             (f"`num_speculative_tokens` {n} is the best N measured below." if best else
              f"`num_speculative_tokens` {n} is the export's default"
              + (": in the measurement below speculation did not beat plain decoding on that machine (best N 0); "
                 "re-measure on your serving hardware." if best == 0 else "."))
             , ""]
    shipped = policy.read(root)  # the serving policy compare --write-policy recorded into the export
    if shipped is not None:
        lines += policy.card_lines(shipped)
    lines += ["## Measured acceptance", "",
              "τ is the mean accepted length per target forward, bonus token included (vLLM's "
              "\"Mean acceptance length\"); acceptance at position k is conditional on positions < k. "
              "Measured with draftsmith's in-tree lossless speculative decoder.", ""]
    if reports:
        k = max(r["num_draft_tokens"] for r in reports)
        lines += ["| dataset | prompts | temperature | draft sampling | N | τ | "
                  + " | ".join(f"acc@{i}" for i in range(1, k + 1)) + " | speedup (in-tree, CPU) | best N |",
                  "|" + "---|" * (7 + k + 1)]
        for r in reports:
            acc = r["conditional_acceptance"] + [None] * (k - len(r["conditional_acceptance"]))
            # the draft's sampling under temperature > 0: vLLM's draft_sample_method to serve with
            method = "-" if not r["sampling"]["temperature"] else r["sampling"].get("draft_sampling", "greedy")
            lines.append(f"| {r['dataset']} | {r['prompts']} | {r['sampling']['temperature']} | {method} | "
                         f"{r['num_draft_tokens']} | {r['tau']:.3f} | "
                         + " | ".join("" if a is None else f"{a:.3f}" for a in acc)
                         + f" | {r['speedup']:.2f}x | {r['best_num_draft_tokens']['best_n']} |")
        lines.append("")
        for r in reports:  # `draftsmith eval --context-buckets`: τ per context length
            lines += context_lines(r)
        for r in reports:
            if (root / r["_dir"] / "acceptance.png").is_file():
                lines += [f"![per-position acceptance on {r['dataset']}]({r['_dir']}/acceptance.png)", ""]
    if comparison:
        lines += compare_lines(*comparison)
    if quant and manifest.get("gate"):
        g, s = manifest["gate"], manifest.get("size", {})
        lines += ["### FP8 vs BF16", "",
                  f"| | τ on {g['dataset']} ({g['prompts']} prompts, N={g['num_draft_tokens']}) | weights |",
                  "|---|---|---|",
                  f"| BF16 | {g['tau_bf16']:.3f} | {s.get('bf16_bytes', 0) / 1e6:.1f} MB |",
                  f"| FP8 | {g['tau_fp8']:.3f} ({g['relative_change']:+.1%}) | {s.get('fp8_bytes', 0) / 1e6:.1f} MB |",
                  "", f"Export refuses an FP8 draft whose τ drops more than {g['max_tau_drop']:.0%} below BF16.", ""]
    lines += ["## Training", ""]
    if train_report:
        f = train_report.get("final", {})
        lines += [f"- {train_report['steps']} optimizer steps on {train_report['world_size']} process(es) "
                  f"({train_report['distributed_type']}), {train_report['seconds'] / 60:.1f} min; final loss "
                  f"{f.get('loss', float('nan')):.3f}, simulated τ {f.get('tau', float('nan')):.2f}"]
        o = train_report.get("optimization")
        if o:  # the objective (the draft's config), the optimizer and the schedule it was trained with
            rate = f"{o['optimizer']} at {o.get('muon_lr', o['learning_rate']):g}" + (
                f" (AdamW at {o['learning_rate']:g} on norms and tables)" if o["optimizer"] == "muon" else "")
            draft = manifest["draft"]
            where = {"all": " at every position", "assistant": " at the answers' positions"}.get(
                draft.get("loss_on"), "")
            lines += [f"- objective `{draft['loss']}`{where}; optimizer {rate}, schedule {o['lr_schedule']}"]
    data_desc = manifest.get("data")
    if isinstance(data_desc, dict):
        data_desc = ", ".join(f"{k}: {v}" for k, v in data_desc.items())
    lines += [f"- data: hidden states of {target['name']} captured by draftsmith"
              + (f" ({data_desc})" if data_desc else ""), ""]
    versions = prov.get("versions", {})
    lines += ["## Provenance", "",
              f"- target: `{target['name']}`, weights sha256 `{target['sha256']}`",
              f"- exported from draft weights sha256 `{manifest['source']['sha256']}`",
              f"- draftsmith commit `{prov.get('git_commit') or 'unknown'}`; "
              + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    card = ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n{{ body }}\n",
                                   body="\n".join(lines))
    validate_card(card.content, target["name"])
    return card.content


def validate_card(content: str, base_model: str) -> None:
    """Offline checks of the card metadata (the Hub's own validator is an online call)."""
    parsed = ModelCard(content).data.to_dict()
    problems = []
    if parsed.get("base_model") != base_model:
        problems.append(f"base_model {parsed.get('base_model')!r} != {base_model!r}")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(base_model)):
        problems.append(f"base_model {base_model!r} is not a Hub repo id (owner/name)")
    if "speculative-decoding" not in (parsed.get("tags") or []):
        problems.append("tag speculative-decoding missing")
    if parsed.get("license") is not None and not re.fullmatch(r"[a-z0-9.+-]+", parsed["license"]):
        problems.append(f"license {parsed['license']!r} is not a license id")
    if problems:
        raise DraftsmithError("model card metadata is invalid: " + "; ".join(problems))


def plan_upload(export_dir: str | Path, repo_id: str, base_model: str | None = None,
                allow_extra: bool = False, compare_dir: str | Path | None = None) -> UploadPlan:
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise DraftsmithError(f"--repo '{repo_id}' is not owner/name")
    manifest, files = check_export(export_dir, allow_extra)
    comparison = None
    if compare_dir:
        report, mine = compared(manifest, compare_dir)
        png = Path(compare_dir).expanduser() / "compare.png"
        if png.is_file():
            files.append(PlannedFile(COMPARE_PLOT, png, png.stat().st_size, sha256_file(png)))
        comparison = (report, mine, png.is_file())
    card = build_card(Path(export_dir), manifest, repo_id, base_model, comparison)
    return UploadPlan(Path(export_dir), files, card, manifest)


def upload(plan: UploadPlan, repo_id: str, private: bool = False, exist_ok: bool = False,
           revision: str | None = None, endpoint: str | None = None) -> str:
    """One commit of the planned files + README.md. Returns the commit URL."""
    token = get_token()
    if not token:
        raise DraftsmithError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    api = HfApi(endpoint=endpoint, token=token)
    where = endpoint or "the Hugging Face Hub"
    try:
        exists = api.repo_exists(repo_id, repo_type="model")
        if exists and not (exist_ok or revision):
            raise DraftsmithError(f"repo '{repo_id}' already exists on {where}; pass --exist-ok to add a commit "
                                  "to it, or --revision BRANCH")
        if not exists:
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=exist_ok)
        if revision:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(f.local)) for f in plan.files]
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=plan.card.encode()))
        info = api.create_commit(repo_id, operations=ops, repo_type="model", revision=revision,
                                 commit_message=f"draftsmith: {plan.manifest['method']} draft for "
                                                f"{plan.manifest['target']['name']}")
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", "?")
        hint = " (is the token valid and allowed to write?)" if status in (401, 403) else ""
        raise DraftsmithError(f"{where} refused the upload: HTTP {status}{hint}") from None
    except Exception as err:  # refused, DNS, timeouts, HF_HUB_OFFLINE=1 (an OSError)
        transport = type(err).__module__.split(".")[0] in TRANSPORT_MODULES
        if not (transport or isinstance(err, OSError)):
            raise
        raise DraftsmithError(f"cannot reach {where}: {type(err).__name__}; check the network or HF_ENDPOINT") from None
    return info.commit_url
