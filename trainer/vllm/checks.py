"""Proving an export in the real vLLM: generation with and without a draft and vLLM's own
counters (trainer/vllm/runners/vllm_generate.py), vLLM's own draft classes built from an
export and run piece by piece (trainer/vllm/runners/vllm_pieces.py), and what their reports
are compared by: the parameters vLLM builds that an export leaves unfilled, and where greedy
outputs diverge only at a near-tie.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from trainer.errors import DraftsmithError
from trainer.families import served_max_model_len
from trainer.vllm.env import RUNNERS, log_cause, require_vllm_python, runner_env, vllm034_python

RUNNER = Path(__file__).resolve().parent / "runners" / "vllm_generate.py"
PIECES_RUNNER = Path(__file__).resolve().parent / "runners" / "vllm_pieces.py"


def run_vllm(target_dir: str, prompts: list[list[int]] | dict, out: Path, draft: str | None = None,
             num_speculative_tokens: int = 3, max_new_tokens: int = 64, dtype: str = "float32",
             cache_root: Path | None = None, timeout: int = 900, logprobs: int = 0, method: str | None = None,
             **options) -> dict:
    """Generation in vLLM (trainer/vllm/runners/vllm_generate.py), with `draft` as its speculator
    under vLLM's speculative `method` (an export records it: draftsmith_export.json); `prompts`
    a list, or {"groups": {name: list}} for counters per group; `options`: the runner's other
    job keys (temperature, seed, draft_sample_method, ...)."""
    job = {"target": str(target_dir), "prompts": prompts, "out": out, "draft": draft, "method": method,
           "num_speculative_tokens": num_speculative_tokens, "max_new_tokens": max_new_tokens, "dtype": dtype,
           "logprobs": logprobs, **options}
    return run_vllm_jobs([job], cache_root, timeout)[0]


def run_vllm_jobs(jobs: list[dict], cache_root: Path | None = None, timeout: int = 1800) -> list[dict]:
    """Several generation jobs (the runner's job dicts: target, prompts, out, draft, method, ...)
    in one vLLM process, one engine after another; their results, in order. vLLM's own cache
    (its model inspection among it) is draftsmith's, shared by every run unless given."""
    python = require_vllm_python("generation in vLLM")
    specs = []
    for job in jobs:
        if job.get("draft") and not job.get("method"):
            raise DraftsmithError(f"generation in vLLM with draft '{job['draft']}' needs its speculative method")
        out = Path(job["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        if job.get("max_model_len") is None:  # 1024 at most, above a LongRoPE target's original length
            text = AutoConfig.from_pretrained(job["target"]).get_text_config()
            job = {**job, "max_model_len": served_max_model_len(text, min(1024, text.max_position_embeddings))}
        specs.append({k: str(v) if isinstance(v, Path) else v for k, v in job.items() if v is not None})
    first = Path(specs[0]["out"])
    jobs_file = first.with_suffix(".jobs.json")
    jobs_file.write_text(json.dumps(specs))
    _run([python, str(RUNNER), "--jobs", str(jobs_file)], first, cache_root, timeout)
    return [json.loads(Path(s["out"]).read_text()) for s in specs]


def _run(cmd: list[str], out: Path, cache_root: Path | None, timeout: int) -> dict:
    # the engine in-process: the runner inspects the draft; vLLM's cache shared across runs
    env = runner_env(cache_root)
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if r.returncode != 0:
        raise DraftsmithError(f"vLLM run failed (exit {r.returncode}); the log is {log}; {log_cause(log)}")
    return json.loads(out.read_text())


def load_in_vllm034(jobs: list[dict], timeout: int = 900) -> list[dict]:
    """Each export built with vLLM 0.34's own draft class and its weights loaded (no forward: the
    GPU wheel has no CPU kernels), in one process of the 0.34 environment: the results of
    trainer/vllm/runners/vllm034_load.py, in order. jobs: {"target", "export", "dtype",
    "num_speculative_tokens", "out"}."""
    python = vllm034_python()
    if python is None:
        raise DraftsmithError("the vLLM 0.34 load check needs its environment: run scripts/setup_vllm034.sh (or set "
                              "DRAFTSMITH_VLLM034_PYTHON to its python)")
    first = Path(jobs[0]["out"])
    first.parent.mkdir(parents=True, exist_ok=True)
    jobs_file = first.with_suffix(".jobs.json")
    jobs_file.write_text(json.dumps([{k: str(v) if isinstance(v, Path) else v for k, v in j.items()} for j in jobs]))
    log = first.with_suffix(".log")
    env = runner_env(python=python)  # its own vLLM cache: 0.32's inspections are not 0.34's
    env.pop("VLLM_TARGET_DEVICE", None)  # the runner sets the CPU platform itself
    with open(log, "w") as f:
        r = subprocess.run([python, str(RUNNERS / "vllm034_load.py"), "--jobs", str(jobs_file)], stdout=f,
                           stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if r.returncode != 0:
        raise DraftsmithError(f"the vLLM 0.34 load check failed (exit {r.returncode}); the log is {log}; "
                              f"{log_cause(log)}")
    return [json.loads(Path(j["out"]).read_text()) for j in jobs]


def shared_at_serve_time(export_dir: Path, method: str) -> set[str]:
    """The draft parameters vLLM fills from the target when it serves (so an export leaves them
    unfilled in a load check): the embedding always, the LM head where the export has none of its
    own, and a block draft's mask embedding (vLLM's DFlash/DSpark drafters build it from the
    target's embedding: vllm/model_executor/models/qwen3_dflash.py, 0.32 and 0.34)."""
    with safe_open(Path(export_dir) / "model.safetensors", "pt") as f:
        own_head = any(k.endswith("lm_head.weight") for k in f.keys())
    return {"model.embed_tokens.weight"} | ({"model.mask_embedding"} if method != "eagle3" else set()) \
        | (set() if own_head else {"lm_head.weight"})


def run_vllm_pieces(target_dir: str, export_dir: Path, inputs: dict, out: Path, dtype: str = "float32",
                    cache_root: Path | None = None, timeout: int = 900) -> tuple[dict, dict]:
    """vLLM's own draft (DFlash, DSpark or EAGLE-3) built from `export_dir` on the CPU, its
    weights loaded by vLLM's loader, and its forward run piece by piece on `inputs`
    (trainer/vllm/runners/vllm_pieces.py says what runs and what stands in for the attention
    kernel). Returns (report, tensors): what vLLM derived and loaded, and its fc, context
    keys/values, block hidden states, logits (and DSpark's Markov bias and confidence)."""
    job = {"target": target_dir, "draft": export_dir, "inputs": inputs, "out": out, "dtype": dtype}
    return run_vllm_pieces_many([job], cache_root, timeout)[0]


def run_vllm_pieces_many(jobs: list[dict], cache_root: Path | None = None,
                         timeout: int = 1800) -> list[tuple[dict, dict]]:
    """`run_vllm_pieces` for several exports in one vLLM process (its import and distributed
    setup paid once): jobs are {"target", "draft", "inputs", "out", "dtype"}; one (report,
    tensors) each, in order."""
    python = require_vllm_python("building vLLM's draft modules")
    specs = []
    for job in jobs:
        out = Path(job["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        inputs_file = out.with_suffix(".inputs.safetensors")
        save_file({k: v.contiguous() for k, v in job["inputs"].items()}, str(inputs_file))
        specs.append({"target": str(job["target"]), "draft": str(job["draft"]), "inputs": str(inputs_file),
                      "out": str(out), "dtype": job.get("dtype", "float32")})
    first = Path(specs[0]["out"])
    jobs_file = first.with_suffix(".jobs.json")
    jobs_file.write_text(json.dumps(specs))
    _run([python, str(PIECES_RUNNER), "--jobs", str(jobs_file)], first, cache_root, timeout)
    return [(json.loads(Path(s["out"]).read_text()), load_file(s["out"] + ".safetensors")) for s in specs]


def vllm_parameter_names(name: str) -> str | None:
    """Our export's tensor name -> the draft parameter vLLM loads it into (its module
    path; the quantization prefix model.layers.{L_target + i} is another name):
    `model.` prefix, q/k/v fused into qkv_proj and gate/up into gate_up_proj, d2t ->
    draft_id_to_target_id; None for t2d (vLLM skips it); EAGLE-3's midlayer is layers.0.
    Follows vLLM 0.32's qwen3_dflash.py / llama_eagle3.py load_weights and their stacked mappers."""
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
