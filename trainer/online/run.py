"""An online run's source of states, set up for every trainer rank: the target here (hf), or
producers joined to the run's Ray channel, started by the first rank: hf producers as Ray actors
on the nodes `online.producer_resources` picks (trainer/online/producer.py), or vLLM producers
(trainer/vllm/online.py) on this machine, or on those nodes; on a local Ray cluster (`online.address` null) or one
the user started across machines (`online.address`, docs/online-cluster.md)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from trainer.data.collate import PreparedSamples
from trainer.data.shards import bytes_per_token
from trainer.io import atomic_write_json, cache_root
from trainer.online.channel import cluster_auth, find_channel, join_cluster, open_channel, use_auth
from trainer.online.producer import node_line, start_hf_producers
from trainer.online.sources import CachedSource, ChannelSource, HFSource, Watch
from trainer.vllm.online import RemoteProducers, served_dtype, settings_for, start_producers, start_remote_producers

RUN = ".online.json"  # in the run's output folder: the first rank's cluster address and channel, for the others
LOGS = "online-logs"  # under draftsmith's cache: the producers' logs of a run that failed before its first checkpoint


class Online:
    """This rank's source (`.source`), and what the first rank started (the producers, the
    channel), stopped by `close()`: the producers' logs stay in `<output_dir>/.online/`, their
    states' staging folders go. `summary`: one line for the run's start (what the buffer costs,
    the producer's dtype)."""

    def __init__(self, source, producer=None, channel=None, work: Path | None = None, summary: str = ""):
        self.source, self.producer, self.channel, self.work = source, producer, channel, work
        self.summary = summary

    def close(self) -> None:
        self.source.close()
        if self.producer is not None:
            self.producer.stop()
            for staging in self.work.glob("states-*"):
                shutil.rmtree(staging, ignore_errors=True)
            (self.work.parent / RUN).unlink(missing_ok=True)


def open_online(cfg, *, target, prepared: PreparedSamples, layer_ids: list[int], max_model_len: int, out: Path,
                rank: int, world: int, barrier) -> Online:
    """`cfg`: the run's `online` section; `barrier`: waits for every rank (accelerate's)."""
    online = _open(cfg, target, prepared, layer_ids, max_model_len, out, rank, world, barrier)
    if cfg.cache_tokens:
        online.source = CachedSource(online.source, out / ".online" / f"cache-{rank}", cfg.cache_tokens)
    buffer = cfg.buffer_tokens * bytes_per_token(len(layer_ids), target.hidden_size, cfg.store_dtype)
    online.summary = (f"online: buffer {cfg.buffer_tokens:,} tokens = {human_bytes(buffer)} per rank "
                      f"({cfg.store_dtype} states){online.summary}")
    return online


def _open(cfg, target, prepared, layer_ids, max_model_len, out, rank, world, barrier) -> Online:
    if cfg.hf_in_process:
        return Online(HFSource(target, prepared, layer_ids, cfg.store_dtype, cfg.max_tokens_per_batch,
                               cfg.buffer_tokens))
    work = out / ".online"
    producer = channel = None
    hf = cfg.engine == "hf"
    dtype = None if hf else cfg.target_dtype or served_dtype(target.hf_dir)
    run = None
    if rank == 0:
        address = join_cluster(cfg.address)
        name = f"draftsmith-{os.getpid()}-{int(time.time())}"
        channel = open_channel(name, world, cfg.buffer_tokens)
        if hf:
            producer = start_hf_producers(target, name, layer_ids, cfg, address, cfg.start_timeout_s)
        elif cfg.producer_resources:  # on the nodes that offer them, this machine or others
            settings = settings_for(cfg, layer_ids, target.num_layers, max_model_len, dtype)
            producer = start_remote_producers(target, address, name, settings, work, cfg, cfg.start_timeout_s,
                                              cluster_auth())
        else:
            settings = settings_for(cfg, layer_ids, target.num_layers, max_model_len, dtype)
            producer = start_producers(target.hf_dir, address, name, settings, work, cfg.data_parallel_size,
                                       cfg.devices)
        run = {"address": address, "channel": name}
        atomic_write_json(out / RUN, run)
        run["auth"] = cluster_auth()  # never on disk
    run = share(run, world, barrier)  # not through the output folder: ranks on other machines may not share it
    if rank != 0:
        use_auth(run["auth"])  # the cluster rank 0 started checks a token: Ray sends it when told to
        join_cluster(run["address"])
        channel = find_channel(run["channel"])
    if hf and producer is not None:
        watch = Watch(producer.describe, lambda: _todo(out, lambda: None) + producer.todo(), producer.alive)
    elif producer is not None:  # the first rank watches them, and keeps their logs if the run's folder goes
        watch = Watch(producer.describe, lambda: _todo(out, lambda: producer.keep_logs(cache_root() / LOGS / name))
                      + producer.todo(), producer.alive)
    else:
        watch = Watch(lambda: f"the producer of channel {run['channel']}", lambda: _todo(out, lambda: None))
    source = ChannelSource(channel, rank, prepared, cfg.buffer_tokens, cfg.timeout_s, cfg.start_timeout_s, watch)
    if hf:
        where = "" if producer is None else f" on node {', '.join(node_line(w) for w in producer.where)}"
        summary = (f"; {cfg.data_parallel_size} hf producer(s) through the Ray cluster at {run['address']}{where}, "
                   f"resources {cfg.producer_resources or 'any'}")
    else:
        why = "" if cfg.target_dtype else ", its config's"
        where = (f"; {cfg.data_parallel_size} vLLM producer(s) through the Ray cluster at {run['address']} on node "
                 f"{', '.join(node_line(w) for w in producer.where)}, resources {cfg.producer_resources}"
                 if isinstance(producer, RemoteProducers) else "")
        summary = f"; the vLLM producer runs the target in {dtype}{why}{where}"
    return Online(source, producer, channel, work, summary=summary)


def share(obj, world: int, barrier):
    """The first rank's `obj`, on every rank (torch.distributed's broadcast where several run)."""
    barrier()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _todo(out: Path, keep_logs) -> str:
    """What to run after an online failure: resume from the newest complete checkpoint, or, with
    none yet (the failed run's folder goes, its logs kept elsewhere: `keep_logs`), run again."""
    done = sorted((int(c.name[11:]), c.name) for c in (out / "checkpoints").glob("checkpoint_*")
                  if c.is_dir() and c.name[11:].isdigit())
    if done:
        return f"resume=latest continues from {done[-1][1]}"
    keep_logs()
    return "no checkpoint was written yet (save_every): run the same command again"


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB"):
        if n < 1024:
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"
