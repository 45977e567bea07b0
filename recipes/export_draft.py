"""Export a trained draft as a folder vLLM loads with `--speculative-config`, in BF16 or
FP8 (AMD Quark; the algorithm's exporter names what stays BF16, e.g. EAGLE-3's lm_head and
fc), and gate the FP8 draft on its acceptance.

    draftsmith export --draft runs/demo/eagle3 --output-dir runs/demo/export-bf16
    draftsmith export --draft runs/demo/eagle3 --output-dir runs/demo/export-fp8 --quantize fp8
    draftsmith export --draft DIR --output-dir OUT --format speculators --overwrite
    draftsmith export --draft runs/demo/dspark --output-dir OUT --draft-option draft_topk=64
    flags: --target --format vllm|speculators --dtype --quantize none|fp8 --quantize-fc --keep-qkv-bf16
           --num-draft-tokens N --draft-option K=V --no-gate --max-tau-drop F --overwrite; any field as key=value

Without --num-draft-tokens, the serve command and the gate use the positions the draft was
trained on (EAGLE-3: its TTT steps; DFlash: its block's K-1; DSpark: its block's K).

The FP8 gate decodes held-out prompts (greedy) with the in-tree decoder twice, with the
BF16 export and with the FP8 one (FP8 weights dequantized, FP8 activation rounding
simulated as vLLM does it), and refuses to publish an FP8 draft whose τ falls more
than `max_tau_drop` (a fraction) below the BF16 τ.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from export import formats, quark
from export.load import load_proposer
from recipes._common import one_line_errors, parse_flags, prompt_ids, target_for
from trainer.config import ExportConfig, to_yaml
from trainer.data.chat import read_template, template_file
from trainer.data.evalsets import dataset_file, load_prompts
from trainer.drafts.registry import get
from trainer.errors import DraftsmithError
from trainer.families import serve_max_model_len
from trainer.io import check_space, fresh_output_dir, guard_output, publish_dir, write_run_files
from trainer.speculative import measure
from trainer.target import load_target, resolve_target
from trainer.vllm.servable import PLUGIN_INSTALL, target_servability

FLAGS = ("draft", "output_dir", "target", "chat_template", "format", "dtype", "quantize", "fp8_scheme",
         "num_draft_tokens", "gate_dataset", "gate_prompts", "max_tau_drop")
REPEATED = {"--draft-option": ("draft_options", "KEY=VALUE")}
SWITCHES = {"--overwrite": "overwrite=true", "--quantize-fc": "quantize_fc=true", "--no-gate": "gate=false",
            "--keep-qkv-bf16": "quantize_qkv=false", "--no-chat-template": "no_chat_template=true"}


def run(cfg: ExportConfig, argv=None) -> dict:
    # resolve: the trained draft and its target (once: the one it records, unless --target names another)
    out, draft_dir = Path(cfg.output_dir), Path(cfg.draft)
    source = resolve_target(target_for(str(draft_dir), cfg.target))
    # check, before any work: the gate's template, the output folder, what is asked of the format, servability
    if cfg.quantize != "none" and cfg.gate:
        read_template(cfg.chat_template, "export --chat-template (the FP8 gate's prompts)")
    gate_inputs = [dataset_file(cfg.gate_dataset), template_file(cfg.chat_template)] if cfg.quantize != "none" else []
    guard_output(out, [draft_dir, source.path, *gate_inputs], "export", cfg.overwrite)
    draft_cfg, state = formats.read_draft_dir(draft_dir)  # the module's tensors, as training wrote them
    if cfg.num_draft_tokens is None:  # serve what was trained
        cfg.num_draft_tokens = get(draft_cfg["algorithm"]).Config(**draft_cfg["draft"]).num_positions
    formats.check_export_options(draft_cfg["algorithm"], cfg.format, cfg.quantize, cfg.num_draft_tokens,
                                 draft_cfg["draft"], cfg.draft_options)
    method = formats.exporter(draft_cfg["algorithm"]).METHOD
    served = target_servability(source, method)  # from the target's config alone
    if not served.servable and cfg.require_servable:
        raise DraftsmithError(f"export: {served.line} (require_servable=true; set it false to go on anyway)")
    staging = fresh_output_dir(out, cfg.overwrite)  # refuses an existing output_dir before any work
    try:
        # the weights at most as trained (float32; bf16 and FP8 write less), the configs and the gate's report
        check_space(staging, sum(t.numel() * t.element_size() for t in state.values()) + (4 << 20),
                    f"export into '{out}'")
        # produce: the export in a staging folder (BF16, or FP8 through Quark and its gate)
        target = load_target(source)
        formats.check_against_target(draft_cfg, target, draft_dir)
        extra = {"command": "draftsmith export " + " ".join(argv or []),
                 "servable": {"servable": served.servable, "line": served.line}}
        if cfg.quantize == "none":
            manifest = formats.write_export(staging, draft_cfg, state, target, cfg.format, cfg.dtype,
                                            cfg.num_draft_tokens, draft_dir, extra, cfg.draft_options)
        else:
            manifest = export_fp8(cfg, staging, draft_cfg, state, target, draft_dir, extra)
        # publish: the run files, the manifest over every file (last), the folder in one rename
        write_run_files(staging, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash}, argv,
                        stage="export")
        if serve_max_model_len(target.model.config.get_text_config()):  # a LongRoPE target: its length named
            manifest["serve_max_model_len"] = serve_max_model_len(target.model.config.get_text_config())
        manifest = formats.write_manifest(staging, {k: v for k, v in manifest.items() if k != "files"})
        publish_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest["serve"] = formats.serve_command(target.hf_dir, str(out), cfg.num_draft_tokens, manifest["method"],
                                              manifest.get("serve_max_model_len"))
    return manifest


def export_fp8(cfg: ExportConfig, staging: Path, draft_cfg: dict, state: dict, target, draft_dir: Path,
               extra: dict) -> dict:
    """BF16 export in a scratch dir -> Quark file-to-file FP8 into `staging` -> the gate."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-bf16-") as scratch:
        bf16 = Path(scratch) / "bf16"
        bf16.mkdir()
        bf16_manifest = formats.write_export(bf16, draft_cfg, state, target, "vllm", "bfloat16",
                                             cfg.num_draft_tokens, draft_dir, extra, cfg.draft_options)
        keep = formats.exporter(draft_cfg["algorithm"]).keep_bf16(draft_cfg["draft"], cfg.quantize_fc,
                                                                  cfg.quantize_qkv)
        print(f"quantizing with AMD Quark ({cfg.fp8_scheme}; kept in BF16: {', '.join(sorted(keep))})")
        qcfg = quark.quantize_fp8(bf16, staging, keep, cfg.fp8_scheme)
        (staging / formats.EXPORT_MANIFEST).unlink(missing_ok=True)  # Quark copied the BF16 one
        (staging / "model.safetensors.index.json").unlink(missing_ok=True)  # one file: the index is noise
        bf16_bytes = (bf16 / formats.WEIGHTS).stat().st_size
        fp8_bytes = (staging / formats.WEIGHTS).stat().st_size
        manifest = {**{k: v for k, v in bf16_manifest.items() if k != "files"},
                    "quantization": {"tool": "amd-quark", "scheme": cfg.fp8_scheme, "exclude": qcfg["exclude"],
                                     "keep_bf16": sorted(keep), "quantize_fc": cfg.quantize_fc,
                                     "quantize_qkv": cfg.quantize_qkv},
                    "size": {"bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes, "ratio": fp8_bytes / bf16_bytes}}
        if cfg.gate:
            manifest["gate"] = fp8_gate(cfg, bf16, staging, manifest, target)
    return manifest


def fp8_gate(cfg: ExportConfig, bf16_dir: Path, fp8_dir: Path, manifest: dict, target) -> dict:
    # the FP8 folder is not complete yet: give load_export the manifest it checks
    formats.write_manifest(fp8_dir, {k: v for k, v in manifest.items() if k != "files"})
    prompts = prompt_ids(target, load_prompts(cfg.gate_dataset, cfg.gate_prompts), cfg.draft, cfg.chat_template,
                         cfg.no_chat_template, "export --chat-template (the FP8 gate's prompts)")
    taus = {}
    for name, path in (("bf16", bf16_dir), ("fp8", fp8_dir)):
        draft, _ = load_proposer(str(path), target, **cfg.draft_options)
        stats = measure(target, draft, prompts, cfg.gate_max_new_tokens, cfg.num_draft_tokens,
                        eos_token_ids=target.eos_token_ids, progress=f"FP8 gate: {name} draft")
        taus[name] = stats.tau
    change = taus["fp8"] / taus["bf16"] - 1 if taus["bf16"] else 0.0
    gate = {"dataset": cfg.gate_dataset, "prompts": len(prompts), "max_new_tokens": cfg.gate_max_new_tokens,
            "num_draft_tokens": cfg.num_draft_tokens, "tau_bf16": taus["bf16"], "tau_fp8": taus["fp8"],
            "relative_change": change, "max_tau_drop": cfg.max_tau_drop}
    if change < -cfg.max_tau_drop:
        raise DraftsmithError(
            f"FP8 gate failed: τ {taus['fp8']:.3f} (FP8) vs {taus['bf16']:.3f} (BF16) on {cfg.gate_dataset} "
            f"({len(prompts)} prompts) is a {-change:.1%} drop, above max_tau_drop={cfg.max_tau_drop:.1%}; "
            f"keep more layers in BF16{' (drop --quantize-fc)' if cfg.quantize_fc else ''} or raise --max-tau-drop. "
            "Nothing was written")
    return gate


def format_summary(m: dict) -> str:
    lines = [f"export: {m['algorithm']} draft for {m['target']['name']}, format {m['format']}, "
             f"{'FP8 ' + m['quantization']['scheme'] if m.get('quantization') else m['dtype']}",
             f"  aux layer ids {m['draft']['aux_layer_ids']} ({m['layer_id_convention']}), draft vocab "
             f"{m['draft'].get('draft_vocab_size') or 'the target head'}, files: "
             + ", ".join(f"{k} ({v['bytes'] / 1e6:.1f} MB)"
                                                                   for k, v in m["files"].items()
                                                                   if v["bytes"] > 100_000)]
    if m.get("size"):
        s = m["size"]
        lines.append(f"  weights {s['fp8_bytes'] / 1e6:.1f} MB FP8 vs {s['bf16_bytes'] / 1e6:.1f} MB BF16 "
                     f"({1 - s['ratio']:.0%} smaller; {', '.join(m['quantization']['keep_bf16'])} stay BF16)")
    if m.get("gate"):
        g = m["gate"]
        lines.append(f"  FP8 gate on {g['dataset']} ({g['prompts']} prompts, N={g['num_draft_tokens']}): "
                     f"τ {g['tau_fp8']:.3f} FP8 vs {g['tau_bf16']:.3f} BF16 ({g['relative_change']:+.1%}; "
                     f"bound -{g['max_tau_drop']:.0%})")
    if m.get("serve"):
        lines.append(f"  serve: {m['serve']}")
    if m.get("servable") and "with draftsmith's vLLM plugin" in m["servable"]["line"]:
        lines.append(f"  needs, beside the vLLM that serves it: draftsmith's vLLM plugin ({PLUGIN_INSTALL})")
    if m.get("servable") and not m["servable"]["servable"]:
        lines.append(f"  warning: {m['servable']['line']}")
    return "\n".join(lines)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_flags(ExportConfig, argv, __doc__, FLAGS, SWITCHES, prog="draftsmith export", repeated=REPEATED)
    manifest = run(cfg, argv)
    print(format_summary(manifest))
    print(f"  written to {cfg.output_dir}")


if __name__ == "__main__":
    main()
