"""Proving an export in the real vLLM: run `export/runners/vllm_generate.py` in a vLLM
environment, and build the constant-proposal probe draft.

The probe (see ../shared/FORMATS.md): a draft whose final norm weight is zero has all-zero
logits, so it always proposes the lowest target id of its vocabulary, in vLLM
(`compute_logits` scatters into -inf, argmax takes the first 0) and in-tree alike. With a
contiguous vocabulary starting at token X (d2t[i] = X), that token is X. Given the
target's greedy output, the number of accepted drafts is then known exactly
(`expected_probe_acceptance`). A wrong d2t, weight name or config field changes it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from export.vllm_env import require_vllm_python, runner_env, vllm_python
from trainer.errors import DraftsmithError
from trainer.io import atomic_write_json

__all__ = ["vllm_python"]  # and the checks below

RUNNER = Path(__file__).resolve().parent / "runners" / "vllm_generate.py"
PIECES_RUNNER = Path(__file__).resolve().parent / "runners" / "vllm_pieces.py"


def run_vllm(target_dir: str, prompts: list[list[int]] | dict, out: Path, draft: str | None = None,
             num_speculative_tokens: int = 3, max_new_tokens: int = 64, dtype: str = "float32",
             cache_root: Path | None = None, timeout: int = 900, logprobs: int = 0, method: str | None = None) -> dict:
    """Greedy generation in vLLM (export/runners/vllm_generate.py), with `draft` as its speculator
    (its method from the export's manifest, or `method` for a folder that is no draftsmith export);
    `prompts` a list, or {"groups": {name: list}} for counters per group."""
    python = require_vllm_python("generation in vLLM")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts_file = out.with_suffix(".prompts.json")
    prompts_file.write_text(json.dumps(prompts))
    cmd = [python, str(RUNNER), "--target", target_dir, "--prompts", str(prompts_file), "--out", str(out),
           "--max-new-tokens", str(max_new_tokens), "--dtype", dtype, "--logprobs", str(logprobs)]
    if draft:  # vLLM's speculative method is the export's (its manifest says which)
        from export import formats

        method = method or json.loads((Path(draft) / formats.EXPORT_MANIFEST).read_text())["method"]
        cmd += ["--draft", str(draft), "--num-speculative-tokens", str(num_speculative_tokens), "--method", method]
    return _run(cmd, out, cache_root, timeout)


def _run(cmd: list[str], out: Path, cache_root: Path | None, timeout: int) -> dict:
    env = runner_env(cache_root or out.parent / "vllm-cache")  # the engine in-process: the runner inspects the draft
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if r.returncode != 0:
        tail = log.read_text()[-3000:]
        raise DraftsmithError(f"vLLM run failed (exit {r.returncode}), log {log}:\n{tail}")
    return json.loads(out.read_text())


def run_vllm_pieces(target_dir: str, export_dir: Path, inputs: dict, out: Path, dtype: str = "float32",
                    cache_root: Path | None = None, timeout: int = 900) -> tuple[dict, dict]:
    """vLLM's own block draft (DFlash or DSpark) built from `export_dir` on the CPU, its
    weights loaded by vLLM's loader, and its forward run piece by piece on `inputs`
    (export/runners/vllm_pieces.py says what runs and what stands in for the attention
    kernel). Returns (report, tensors): what vLLM derived and loaded, and its fc, context
    keys/values, block hidden states, logits (and DSpark's Markov bias and confidence)."""
    from safetensors.torch import load_file, save_file

    python = require_vllm_python("building vLLM's draft modules")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    inputs_file = out.with_suffix(".inputs.safetensors")
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(inputs_file))
    cmd = [python, str(PIECES_RUNNER), "--target", target_dir, "--draft", str(export_dir), "--inputs",
           str(inputs_file), "--out", str(out), "--dtype", dtype]
    report = _run(cmd, out, cache_root, timeout)
    return report, load_file(str(out) + ".safetensors")


def make_probe(src_export: Path, out: Path, token: int) -> None:
    """A copy of a BF16 vLLM-native export that always proposes `token` (the algorithm's
    exporter says how: `probe`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from export import formats

    manifest = json.loads((src_export / formats.EXPORT_MANIFEST).read_text())
    if manifest["format"] != "vllm" or manifest.get("quantization"):
        raise DraftsmithError("the probe is built from a BF16 vLLM-native export")
    config = json.loads((src_export / "config.json").read_text())
    config, w, d = formats.exporter(manifest["algorithm"]).probe(config, load_file(src_export / formats.WEIGHTS),
                                                                 manifest["draft"], token)
    shutil.copytree(src_export, out)
    save_file(w, str(out / formats.WEIGHTS), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", config)
    body = {k: v for k, v in manifest.items() if k != "files"}
    formats.write_manifest(out, {**body, "draft": d, "probe_token": token})


def vllm_parameter_names(name: str) -> str | None:
    """Our export's tensor name -> the draft parameter vLLM loads it into (its module
    path; the quantization prefix model.layers.{L_target + i} is another name):
    `model.` prefix, q/k/v fused into qkv_proj and gate/up into gate_up_proj, d2t ->
    draft_id_to_target_id; None for t2d (vLLM skips it); EAGLE-3's midlayer is layers.0.
    Follows vLLM 0.32's qwen3_dflash.py / llama_eagle3.py load_weights and their stacked mappers."""
    import re

    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    if name.startswith("lm_head."):
        return name
    name = name.replace("midlayer.", "layers.0.", 1)  # EAGLE-3: llama_eagle3.py renames its one layer
    name = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", name)
    name = re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name)
    return "model." + name


def missing_in_vllm(export_tensors: list[str], loaded: list[dict]) -> list[str]:
    """vLLM draft parameters that no tensor of the export fills. vLLM's DFlash loader does not
    report them: a missing norm silently stays at ones. Shared parameters (the target's
    embedding and, without a head of its own, LM head) and FP8 scales are not expected."""
    filled = {vllm_parameter_names(n) for n in export_tensors}
    shared = ("model.embed_tokens.", "model.mask_embedding")
    own_head = any(n.startswith("lm_head.") for n in export_tensors)
    return sorted(p["name"] for p in loaded
                  if p["name"] not in filled and not p["name"].startswith(shared) and "scale" not in p["name"]
                  and (own_head or not p["name"].startswith("lm_head.")))


def expected_probe_acceptance(output: list[int], token: int, n: int) -> dict:
    """What a draft that always proposes `token` gets accepted on a greedy `output`
    (generated tokens only). The first token comes from the prefill; each later round
    drafts n tokens, accepts the leading run equal to the target's next tokens, and
    commits it plus one target token. Rounds happen while tokens remain to generate.
    Choose `token` absent from the last n+1 tokens (`pick_probe_token`): what vLLM would
    accept beyond max_tokens is not in `output`."""
    drafts = accepted = 0
    per_pos = [0] * n
    c = 1
    while c < len(output):
        k = 0
        while k < n and c + k < len(output) and output[c + k] == token:
            k += 1
        drafts += 1
        accepted += k
        for j in range(k):
            per_pos[j] += 1
        c += k + 1
    return {"num_drafts": drafts, "num_accepted_tokens": accepted, "accepted_per_position": per_pos}


def pick_probe_token(outputs: list[list[int]], n: int, max_token: int, exclude=()) -> int:
    """The token most frequent in the greedy outputs, not within the last n+1 tokens of any
    output, not special (`exclude`), and <= max_token (= V - Vd)."""
    from collections import Counter

    banned = set(exclude) | {t for o in outputs for t in o[-(n + 1):]}
    counts = Counter(t for o in outputs for t in o[1:] if t not in banned and t <= max_token)
    if not counts:
        raise DraftsmithError("no usable probe token in the outputs; generate more tokens")
    return counts.most_common(1)[0][0]


def greedy_divergences(base: dict, run: dict, tie: float) -> list[dict]:
    """Where `run`'s greedy tokens leave `base`'s (vLLM without a draft, run with
    logprobs=2). A lossless draft changes nothing, but in bf16 the target's verification
    of N+1 tokens rounds differently from one token at a time, so a near-tie between the
    top two logits may flip. Returns one entry per diverging prompt with the baseline's
    top-2 gap there; a gap above `tie` is an error the caller should fail on."""
    out = []
    for i, (a, b) in enumerate(zip(base["outputs"], run["outputs"], strict=True)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None and len(a) == len(b):
            continue
        j = min(len(a), len(b)) if j is None else j
        top = base["top_logprobs"][i][j] if base.get("top_logprobs") and j < len(a) else None
        gap = top[0][1] - top[1][1] if top and len(top) > 1 else float("inf")
        out.append({"prompt": i, "position": j, "gap": gap, "near_tie": gap <= tie})
    return out
