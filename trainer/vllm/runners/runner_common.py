"""What several runners do before their work, written once. Runners run by path with a vLLM
environment's Python, so this file is imported as a sibling (`import runner_common`): it imports only
the standard library at the top, and vllm inside the function that needs it.

- `beside_draftsmith()`: the runners' folder and draftsmith's root on sys.path (the capture connector
  and the states engine by name; the shard writer and the online wire format), and the runners'
  folder on PYTHONPATH for vLLM's tensor-parallel worker processes, which import the connector too.
- `one_rank_world()`: vLLM's distributed state for one process (a gloo world of one on a free local
  port), what building a model outside an engine needs.
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
