"""What several runners do before their work, written once. Runners run by path with a vLLM
environment's Python, so this file is imported as a sibling (`import runner_common`): it imports only
the standard library at the top, and vllm inside the function that needs it.

- `beside_draftsmith()`: the runners' folder and draftsmith's root on sys.path (the capture connector
  and the states engine by name; the shard writer and the online wire format), and the runners'
  folder on PYTHONPATH for vLLM's tensor-parallel worker processes, which import the connector too.
- `one_rank_world()`: vLLM's distributed state for one process (a gloo world of one on a free local
  port), what building a model outside an engine needs.
- `inspect_models_in_process()`: on vLLM's CPU build, a model class's first inspection runs here
  instead of in a subprocess of its own.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def beside_draftsmith() -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parents[2]))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


def one_rank_world() -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)


def inspect_models_in_process() -> None:
    """vLLM inspects a model class it holds no cached info for (vLLM's cache: VLLM_CACHE_ROOT/modelinfos,
    per module hash) in a Python subprocess of its own, so as not to initialize CUDA in this one: ~7 s a
    class here, paid by a fresh machine's first engine of each class (14 classes in the test suite).
    vLLM's CPU build has no CUDA to keep out of this process: there it inspects here, importing the one
    model module, and writes the same cache entry (vllm/model_executor/models/registry.py,
    `_run_in_subprocess`: 0.32 and 0.34 call it from `inspect_model_cls`, 0.34 also from
    `fill_model_info_cache`, which draftsmith does not call). Elsewhere nothing changes."""
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = lambda fn: fn()
