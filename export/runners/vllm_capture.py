"""Capture a target's hidden states through vLLM into draftsmith capture shards. Runs with the
Python of a vLLM environment:

    .vllm-venv/bin/python export/runners/vllm_capture.py --target HF_DIR --jobs JOBS_DIR --out CAPTURE_DIR \
        --settings settings.json [--shard I --num-shards N]

The target runs under vLLM's `extract_hidden_states` speculative method with draftsmith's KV
connector (draftsmith_capture_connector.py, beside this file), which writes each request's
states at the requested layers plus the last layer's output before the final norm (layer id
num_layers) to a file; the greedy next token at every position comes from the same forward
(prompt_logprobs=1: the top-1 token at each position; the last position's from the one token
sampled greedily). Each job file JOBS_DIR/shard-KKKKK.safetensors (input_ids, loss_mask,
cu_seqlens, sample_index: the samples of capture shard K) becomes CAPTURE_DIR/shard-KKKKK.safetensors
and its sidecar, written by draftsmith's own shard writer (trainer/data/shards.py: the same
tensors, store dtype, float8 scales, sha256 and atomic writes as the transformers engine), which
this runner loads from the repository; it imports nothing else of draftsmith (the module needs
only torch, safetensors and the standard library). A shard whose sidecar exists is complete:
a killed run is resumed by running again over the jobs not yet done.

settings.json: {"aux_layer_ids", "num_layers", "store_dtype", "dtype", "max_model_len",
"concurrency", "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager" (null: on the
CPU only), "max_num_batched_tokens" (null: vLLM's)}. Data parallelism is the caller's (N
runners, `--shard I --num-shards N`: the jobs K with K % N == I, each on its own devices).
Writes CAPTURE_DIR/.vllm-capture-report-I.json: vLLM's version, engine start and capture seconds,
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    args = ap.parse_args()
    with open(args.settings) as f:
        cfg = json.load(f)
    sys.path.insert(0, str(HERE))  # the connector module, for vLLM to import by name
    sys.path.insert(1, str(HERE.parent.parent))  # draftsmith's shard writer (trainer/data/shards.py)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # TP workers too

    import torch
    from safetensors.torch import load_file

    from trainer.data.shards import pack_samples, shard_name, store_states, write_shard

    out, jobs_dir = Path(args.out), Path(args.jobs)
    jobs = sorted(p for p in jobs_dir.glob("shard-*.safetensors") if int(p.stem.split("-")[1]) % args.num_shards ==
                  args.shard)
    jobs = [p for p in jobs if not (out / shard_name(int(p.stem.split("-")[1]))).with_suffix(".json").is_file()]
    staging = out / f".vllm-states-{args.shard}"
    staging.mkdir(parents=True, exist_ok=True)
    report = {"tokens": 0, "engine_start_s": 0.0, "capture_s": 0.0, "shards": 0}
    if jobs:
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.platforms import current_platform

        ids = sorted(set(cfg["aux_layer_ids"]) | {cfg["num_layers"]})  # vLLM sorts them; the last state is id L
        eager = cfg.get("enforce_eager")
        llm = LLM(model=args.target, tokenizer=args.target, dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
                  enforce_eager=current_platform.is_cpu() if eager is None else eager,
                  max_num_seqs=cfg["concurrency"], tensor_parallel_size=cfg["tensor_parallel_size"],
                  pipeline_parallel_size=cfg["pipeline_parallel_size"], enable_prefix_caching=False,
                  **({"max_num_batched_tokens": cfg["max_num_batched_tokens"]} if cfg.get("max_num_batched_tokens")
                     else {}),
                  speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
                  kv_transfer_config={"kv_connector": "DraftsmithCaptureConnector",
                                      "kv_connector_module_path": "draftsmith_capture_connector",
                                      "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"allow_custom_save_path": True,
                                                                    "shared_storage_path": str(staging)}})
        report["engine_start_s"] = time.perf_counter() - t0
        report["vllm"] = vllm.__version__
        columns = [ids.index(i) for i in cfg["aux_layer_ids"]]  # the stored layers, in the manifest's order
        for job in jobs:
            k = int(job.stem.split("-")[1])
            t1 = time.perf_counter()
            j = load_file(str(job))
            cu = j["cu_seqlens"].tolist()
            samples = [j["input_ids"][cu[s]:cu[s + 1]] for s in range(len(cu) - 1)]
            paths = [staging / f"{k}-{s}.safetensors" for s in range(len(samples))]
            params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False,
                                     extra_args={"kv_transfer_params": {"hidden_states_path": str(p)}})
                      for p in paths]
            outs = llm.generate([TokensPrompt(prompt_token_ids=x.tolist()) for x in samples], params, use_tqdm=False)
            _flush(llm, paths)
            packed = []
            for s, (x, o, p) in enumerate(zip(samples, outs, paths)):
                f = load_file(str(p))
                if not torch.equal(f["token_ids"].long(), x.long()):
                    raise RuntimeError(f"shard {k} sample {s}: the connector's tokens are not the prompt's")
                states = f["hidden_states"].float()  # [P, L+1, H]
                P, H = x.shape[0], states.shape[-1]
                top = [next(t for t, lp in pos.items() if lp.rank == 1) for pos in o.prompt_logprobs[1:]]
                argmax = torch.tensor(top + [o.outputs[0].token_ids[0]], dtype=torch.int32)  # [P]
                stored = store_states(states[:, columns].reshape(P, len(columns) * H), states[:, -1], cfg["store_dtype"])
                packed.append({"input_ids": x, "loss_mask": j["loss_mask"][cu[s]:cu[s + 1]], "target_argmax": argmax,
                               **stored})
            write_shard(out, k, pack_samples(packed, j["sample_index"].tolist()), cfg["aux_layer_ids"])
            for p in paths:
                p.unlink(missing_ok=True)
            report["tokens"] += cu[-1]
            report["shards"] += 1
            report["capture_s"] += time.perf_counter() - t1
            print(json.dumps({"shard": k, "tokens": cu[-1]}), file=sys.stderr, flush=True)
            if 0 < int(os.environ.get("DRAFTSMITH_FAULT_CAPTURE_AFTER_BATCHES", "0")) <= report["shards"]:
                os._exit(17)  # tests: a kill between shards (the transformers engine counts batches)
    staging.rmdir() if staging.is_dir() and not any(staging.iterdir()) else None
    tmp = out / f".vllm-capture-report-{args.shard}.json.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out / f".vllm-capture-report-{args.shard}.json")


def _flush(llm, paths, timeout: float = 600.0) -> None:
    """The connector writes a request's states on an engine step after the request finished:
    step the engine until every file is there."""
    start = time.monotonic()
    while not all(p.is_file() for p in paths):
        if time.monotonic() - start > timeout:
            missing = [p.name for p in paths if not p.is_file()]
            raise RuntimeError(f"the KV connector wrote no states for {missing[:3]} within {timeout:.0f} s")
        llm.llm_engine.step()
        time.sleep(0.001)


if __name__ == "__main__":
    main()
