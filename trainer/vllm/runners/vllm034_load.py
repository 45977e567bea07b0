"""vLLM 0.34's own draft classes built from draftsmith's exports and their weights loaded, on a
CPU (the GPU wheel installed lite: scripts/setup_vllm034.sh). Runs with that environment's
Python (it imports only vllm, torch, safetensors and the standard library, never draftsmith):

    .vllm034-venv/bin/python trainer/vllm/runners/vllm034_load.py --jobs jobs.json

jobs.json: a list of {"target": HF_DIR, "export": EXPORT_DIR, "dtype": "bfloat16" | "float32"
(FP8 exports: bfloat16, vLLM's Quark loader refuses float32), "num_speculative_tokens": N, "out":
RESULT_JSON}. Each result: {"vllm": version, "class": the draft class vLLM built, "method",
"quantization", "parameters": [[name, dtype, shape], ...], "unfilled": the floating parameters
load_weights left untouched, "d2t_filled": whether draft_id_to_target_id was loaded (or null:
no such parameter), "attention": each draft layer's {"layer", "sliding_window", "causal"} as
built} or {"error": the exception's line}.

How (measured: ../shared/research/vllm-0.34-load-check.md): VLLM_TARGET_DEVICE=cpu (else no
platform resolves); the x86 CPU config check, which demands triton-cpu, sees Triton while the
config is made (nothing in build-and-load runs Triton); a gloo world of one. Every floating
parameter is filled with NaN first and draft_id_to_target_id with -1, except the attention
q/k/v/prob scales vLLM defaults itself: a tensor the export lacks stays NaN (vLLM's loader skips
absent tensors silently; it raises on unknown names and wrong shapes). No forward runs: the GPU
wheel has no CPU kernels (vllm._C), and process_weights_after_loading is kernel setup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from runner_common import inspect_models_in_process, one_rank_world

os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # before vllm is imported: else no platform resolves
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

DEFAULTED = ("q_scale", "k_scale", "v_scale", "prob_scale")  # attention scales vLLM sets itself


def patch_triton_check() -> None:
    """The x86 CPU platform's config check demands triton-cpu; build-and-load runs no Triton."""
    import vllm.triton_utils as tu
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check(cls, cfg):
        saved, tu.HAS_TRITON = tu.HAS_TRITON, True
        try:
            return original(cls, cfg)
        finally:
            tu.HAS_TRITON = saved

    CpuPlatform.check_and_update_config = classmethod(check)


def load(job: dict) -> dict:
    import torch
    import vllm
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with open(os.path.join(job["export"], "draftsmith_export.json")) as f:
        method = json.load(f)["method"]
    spec = {"model": job["export"], "method": method, "num_speculative_tokens": job["num_speculative_tokens"]}
    cfg = EngineArgs(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True, max_model_len=512,
                     speculative_config=spec).create_engine_config()
    with set_current_vllm_config(cfg):
        from vllm.distributed.parallel_state import model_parallel_is_initialized

        if not model_parallel_is_initialized():
            one_rank_world()
        with set_default_torch_dtype(cfg.model_config.dtype):
            model = initialize_model(vllm_config=cfg, model_config=cfg.speculative_config.draft_model_config)
        for name, p in model.named_parameters():  # NaN sentinel: a tensor the export lacks stays NaN
            if p.is_floating_point() and not name.endswith(DEFAULTED):
                p.data.fill_(float("nan"))
        d2t = dict(model.named_parameters()).get("draft_id_to_target_id")
        if d2t is not None:
            d2t.data.fill_(-1)
        model.load_weights(load_file(os.path.join(job["export"], "model.safetensors")).items())
        unfilled = sorted(n for n, p in model.named_parameters()
                          if p.is_floating_point() and not n.endswith(DEFAULTED) and torch.isnan(p.float()).any())
        return {"vllm": vllm.__version__, "class": type(model).__name__, "method": method,
                "quantization": cfg.speculative_config.draft_model_config.quantization,
                "parameters": [[n, str(p.dtype).removeprefix("torch."), list(p.shape)]
                               for n, p in model.named_parameters()],
                "unfilled": unfilled, "d2t_filled": None if d2t is None else bool((d2t >= 0).all()),
                "attention": attention_modes(model)}


def attention_modes(model) -> list[dict]:
    """Each draft layer's attention as vLLM built it: {"layer", "sliding_window" (its Attention's,
    None: full), "causal" (a DFlash/DSpark layer's; None where the class has no such flag)}."""
    from vllm.model_executor.layers.attention import Attention

    return [{"layer": name.removesuffix(".attn"), "sliding_window": module.sliding_window,
             "causal": getattr(model.get_submodule(name.removesuffix(".attn")), "causal", None)}
            for name, module in model.named_modules() if isinstance(module, Attention)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", required=True, help="a JSON list of jobs (the module docstring)")
    args = ap.parse_args()
    with open(args.jobs) as f:
        jobs = json.load(f)
    patch_triton_check()
    inspect_models_in_process()  # after the patch: the platform 0.34 sees here is the CPU
    for job in jobs:
        try:
            result = load(job)
        except Exception as err:  # one export's failure is its result; the others still load
            result = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
        with open(job["out"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(job["out"] + ".tmp", job["out"])
        print(json.dumps({"export": job["export"], **{k: result.get(k) for k in ("class", "unfilled", "error")}}),
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
