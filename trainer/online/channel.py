"""The channel between a producer of hidden states and the trainer ranks of one run, through
Ray (the transport vLLM itself uses across nodes; one pip wheel for CPU, CUDA and ROCm hosts):
a Ray actor, owned by the trainer's first rank, that holds

    requests   what each rank needs next: (rank, epoch, seq, sample index, token ids), in order
    results    per rank, the states the producers made, handed out in the rank's request order
               (several producers, data parallel, finish out of order), bounded by `capacity_tokens`
               tokens per rank: a producer's `deliver` waits while the rank's buffer is full
               (back-pressure, never growth; the sample the rank needs next always enters), a
               rank's `take` until its next sample is there
    status     the producer's last report (its engine, tokens/s, the time it waited on a full
               buffer) and when it came

The actor is not detached: it dies with the trainer that made it, and a producer whose next
call fails with RayActorError stops (a trainer that dies stops its producers). Delivery is
at most once: a rank killed inside `take` loses that item, and resumes from its checkpoint.
One machine and several use the same code: a local cluster (`ray.init()` in the trainer) or
one the user started (`ray start --head` / `--address`, `online.address`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque

import ray

NAMESPACE = "draftsmith"


@ray.remote(num_cpus=0, max_concurrency=256)
class Channel:
    def __init__(self, ranks: int, capacity_tokens: int):
        self.requests: deque = deque()
        self.results: list[dict] = [{} for _ in range(ranks)]  # seq -> (item, tokens)
        self.expected = [0] * ranks  # the seq each rank takes next
        self.held = [0] * ranks  # tokens each rank's buffer holds
        self.capacity = capacity_tokens
        self.epoch = [0] * ranks  # what each rank takes now: results of other epochs are dropped
        self.cond = asyncio.Condition()
        self.closed = False
        self.producer: dict = {}
        self.reported = None  # when the producer last reported

    async def request(self, rank: int, epoch: int, items: list) -> None:
        """items: [(seq, index, token_ids)] of `rank` in `epoch`, in the order it will take them."""
        async with self.cond:
            self.requests.extend((rank, epoch, *item) for item in items)
            self.cond.notify_all()

    async def reset(self, rank: int, epoch: int, start: int) -> None:
        """`rank` now takes `epoch` from position `start`: what it asked before, not yet made or not
        yet taken, is dropped."""
        async with self.cond:
            self.epoch[rank], self.expected[rank] = epoch, start
            self.requests = deque(r for r in self.requests if r[0] != rank)
            self.results[rank].clear()
            self.held[rank] = 0
            self.cond.notify_all()

    async def next_requests(self, most: int, timeout: float):
        """Up to `most` requests, oldest first ([] after `timeout` seconds without one); None once closed."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.requests or self.closed), timeout)
            except asyncio.TimeoutError:
                return []
            if self.closed:
                return None
            return [self.requests.popleft() for _ in range(min(most, len(self.requests)))]

    async def deliver(self, rank: int, epoch: int, seq: int, item: dict, tokens: int, timeout: float):
        """Hand `rank` the states of its request `seq`; waits while its buffer is full. True when
        delivered (or dropped: another epoch), False after `timeout` seconds full, None once closed."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(
                    lambda: self.closed or epoch != self.epoch[rank] or seq == self.expected[rank]
                    or self.held[rank] + tokens <= self.capacity), timeout)
            except asyncio.TimeoutError:
                return False
            if self.closed:
                return None
            if epoch == self.epoch[rank]:
                self.results[rank][seq] = (item, tokens)
                self.held[rank] += tokens
                self.cond.notify_all()
            return True

    async def take(self, rank: int, timeout: float):
        """The states `rank` needs next (its request order), or None after `timeout` seconds."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.expected[rank] in self.results[rank]),
                                       timeout)
            except asyncio.TimeoutError:
                return None
            item, tokens = self.results[rank].pop(self.expected[rank])
            self.expected[rank] += 1
            self.held[rank] -= tokens
            self.cond.notify_all()
            return item

    def report(self, stats: dict) -> None:
        self.producer = stats
        self.reported = time.time()

    def status(self) -> dict:
        return {"producer": self.producer, "since_report_s": None if self.reported is None else
                time.time() - self.reported, "held_tokens": list(self.held), "requests": len(self.requests)}

    async def close(self) -> None:
        async with self.cond:
            self.closed = True
            self.cond.notify_all()


def join_cluster(address: str | None) -> str:
    """Join the Ray cluster at `address` ("auto": the one `ray start` made on this machine), or
    with None start one here; returns its address, for a producer to join."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            ray.init(num_cpus=1, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


def open_channel(name: str, ranks: int, capacity_tokens: int):
    """The run's channel (made by the first rank; the handle must be kept: Ray collects an
    actor nobody holds)."""
    return Channel.options(name=name, namespace=NAMESPACE).remote(ranks, capacity_tokens)


def find_channel(name: str, timeout: float = 120.0):
    """Another rank's (or the producer's) handle on the run's channel, waiting for it to exist."""
    start = time.monotonic()
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() - start > timeout:
                raise
            time.sleep(0.5)
