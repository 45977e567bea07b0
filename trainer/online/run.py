"""An online run's source of states, set up for every trainer rank: the target here (hf), or
vLLM producers joined to the run's Ray channel (vllm), started by the first rank on this
machine (`online.address` null: a local Ray cluster) or joining a cluster the user started
across machines (`online.address`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from trainer.data.collate import PreparedSamples
from trainer.io import atomic_write_json
from trainer.online.channel import find_channel, join_cluster, open_channel
from trainer.online.sources import CachedSource, ChannelSource, HFSource
from trainer.vllm.online import settings_for, start_producers

RUN = ".online.json"  # in the run's output folder: the first rank's cluster address and channel, for the others


class Online:
    """This rank's source (`.source`), and what the first rank started (the producers, the
    channel), stopped by `close()`: the producers' logs stay in `<output_dir>/.online/`, their
    states' staging folders go."""

    def __init__(self, source, producer=None, channel=None, work: Path | None = None):
        self.source, self.producer, self.channel, self.work = source, producer, channel, work

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
    return online


def _open(cfg, target, prepared, layer_ids, max_model_len, out, rank, world, barrier) -> Online:
    if cfg.engine == "hf":
        return Online(HFSource(target, prepared, layer_ids, cfg.store_dtype, cfg.max_tokens_per_batch,
                               cfg.buffer_tokens))
    work = out / ".online"
    producer = channel = None
    if rank == 0:
        address = join_cluster(cfg.address)
        name = f"draftsmith-{os.getpid()}-{int(time.time())}"
        channel = open_channel(name, world, cfg.buffer_tokens)
        settings = settings_for(cfg, layer_ids, target.num_layers, max_model_len)
        producer = start_producers(target.hf_dir, address, name, settings, work, cfg.data_parallel_size, cfg.devices)
        atomic_write_json(out / RUN, {"address": address, "channel": name})
    barrier()
    run = json.loads((out / RUN).read_text())
    if rank != 0:
        join_cluster(run["address"])
        channel = find_channel(run["channel"])
    alive = producer.alive if producer is not None else (lambda: True)  # other ranks: the channel's life
    describe = producer.describe if producer is not None else (lambda: f"the producer of channel {run['channel']}")
    source = ChannelSource(channel, rank, prepared, cfg.buffer_tokens, cfg.timeout_s, alive, describe)
    return Online(source, producer, channel, work)
