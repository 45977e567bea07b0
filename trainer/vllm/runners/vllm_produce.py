"""Stream a target's hidden states from vLLM to a training run (online training, no capture on
disk). Runs with the Python of a vLLM environment, with the same Ray version as the trainer's:

    .vllm-venv/bin/python trainer/vllm/runners/vllm_produce.py --address RAY_ADDRESS --channel NAME \
        --target HF_DIR --settings settings.json --staging DIR [--trainer-pid PID]

It joins the run's Ray cluster, finds the run's channel (trainer/online/channel.py, made by the
trainer), and loops: take the oldest requests that fit their ranks' buffers (a chunk of
`concurrency` x 4; the channel holds back what would not fit), compute their states in one vLLM
pass (draftsmith_states.py: extract_hidden_states + draftsmith's connector; the states' files
live in `--staging` only until read, a chunk at a time), and deliver each sample to its trainer
rank. It reports its tokens/s and how long it waited for work that fits (which side is the
bottleneck).

It stops when the channel closes, when the channel is gone (the trainer died: Ray collects
the actor with its owner), or when `--trainer-pid` no longer runs. Started by the trainer as the
leader of its own process group (vLLM's engine core and workers join it), it ends the whole
group when it gets SIGTERM, which on Linux the kernel sends it when the trainer that started it
goes (PR_SET_PDEATHSIG, asked for here, first thing); and a reaper it starts in the group kills
the group once the producer is gone by any means: nothing it started outlives the trainer.
settings.json: the StatesEngine settings (draftsmith_states.py) plus "ranks". Imports vllm, torch, safetensors,
ray, the standard library and draftsmith's shard writer and wire format (trainer/data/shards.py,
trainer/data/wire.py), found beside this folder.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runner_common import beside_draftsmith, inspect_models_in_process


def end_group(signum=signal.SIGTERM, frame=None) -> None:
    """SIGTERM: kill this producer's process group (it leads one: vLLM's engine core and workers
    are in it), itself included; run by hand in someone else's group, only itself."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(128 + signum)


def die_with_trainer(trainer_pid: int | None) -> None:
    """Linux: SIGTERM (end_group) when the trainer that started this process goes. Asked for after
    exec, here: the trainer's threads make a preexec_fn unsafe."""
    signal.signal(signal.SIGTERM, end_group)
    if trainer_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != trainer_pid:  # it went before the request took effect
        end_group()


# The reaper: blocks on a pipe whose only writer is the producer; at EOF (the producer gone, by
# whatever means) it kills the process group, itself included.
REAPER = "import os, signal, sys; os.read(int(sys.argv[1]), 1); os.killpg(os.getpgrp(), signal.SIGKILL)"


def reap_group_after_me() -> None:
    """Leading a process group: start a reaper in it that kills the group once this process is
    gone. The SIGTERM handler (end_group) covers the trainer's death only while it runs: Ray's
    core worker may end this process first (_exit, when the trainer's Ray instance goes), which
    left vLLM's engine core and workers running. The pipe's write end is not inheritable, so
    nothing vLLM starts holds it open."""
    if os.getpgrp() != os.getpid():
        return
    r, w = os.pipe()
    subprocess.Popen([sys.executable, "-c", REAPER, str(r)], pass_fds=(r,), stdin=subprocess.DEVNULL)
    os.close(r)
    reap_group_after_me.keep = w  # open until this process ends


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--channel", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--staging", required=True)
    ap.add_argument("--trainer-pid", type=int, default=None)
    args = ap.parse_args()
    die_with_trainer(args.trainer_pid)
    reap_group_after_me()
    with open(args.settings) as f:
        settings = json.load(f)
    beside_draftsmith()  # the connector and the states engine; draftsmith's shard writer and wire format
    inspect_models_in_process()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray
    import torch
    import vllm
    from draftsmith_states import StatesEngine

    from trainer.data.wire import encode

    ray.init(address=args.address, namespace="draftsmith", log_to_driver=False)
    signal.signal(signal.SIGTERM, end_group)  # Ray's driver sets its own
    channel = ray.get_actor(args.channel, namespace="draftsmith")
    t0 = time.perf_counter()
    engine = StatesEngine(args.target, settings, Path(args.staging))
    signal.signal(signal.SIGTERM, end_group)  # ... and so may the engine
    stats = {"engine": "vllm", "version": vllm.__version__, "engine_start_s": time.perf_counter() - t0,
             "tokens": 0, "compute_s": 0.0, "blocked_s": 0.0, "pid": os.getpid()}

    def report() -> None:
        busy = stats["compute_s"] + stats["blocked_s"]
        stats["tokens_per_s"] = stats["tokens"] / stats["compute_s"] if stats["compute_s"] else 0.0
        stats["blocked_fraction"] = stats["blocked_s"] / busy if busy else 0.0
        channel.report.remote(dict(stats))

    def trainer_alive() -> bool:
        if args.trainer_pid is None:
            return True
        try:
            os.kill(args.trainer_pid, 0)
            return True
        except OSError:
            return False

    report()
    chunk, n = max(4 * settings["concurrency"], 8), 0
    stall_after = int(os.environ.get("DRAFTSMITH_FAULT_PRODUCER_STALL_AFTER_SAMPLES", "0"))
    try:
        while trainer_alive():
            t2 = time.perf_counter()
            requests = ray.get(channel.next_requests.remote(chunk, 1.0))
            if requests is None:  # closed: the run is over
                break
            if not requests:  # nothing asked that fits the ranks' buffers: the trainer is the slower side
                stats["blocked_s"] += time.perf_counter() - t2
                report()
                continue
            n += 1
            t1 = time.perf_counter()
            samples = engine.states([torch.tensor(r[4]) for r in requests], f"chunk{n}")
            stats["compute_s"] += time.perf_counter() - t1
            stalled = False
            for (rank, epoch, seq, index, _), sample in zip(requests, samples):
                if 0 < stall_after <= seq and epoch == 0:
                    stalled = True  # tests: no sample at this position of the first epoch's plan or later
                    continue
                item = {**encode(sample), "seq": seq, "index": index}
                tokens = int(sample["input_ids"].numel())
                if ray.get(channel.deliver.remote(rank, epoch, seq, item, tokens)) is None:
                    break  # closed
                stats["tokens"] += tokens
            report()
            if 0 < int(os.environ.get("DRAFTSMITH_FAULT_PRODUCER_AFTER_CHUNKS", "0")) <= n:
                os._exit(17)  # tests: a producer that dies mid-run
            stall = float(os.environ.get("DRAFTSMITH_FAULT_PRODUCER_STALL_S", "0"))
            if stall and n == 1 or stalled:
                time.sleep(stall or 3600)  # tests: a producer that stalls (its node is then taken away)
    except ray.exceptions.RayActorError:
        pass  # the channel went with its trainer: nothing is left to produce for
    print(json.dumps({"producer": "stopped", **stats}), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
