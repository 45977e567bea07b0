"""The channel between a producer of hidden states and the trainer ranks of one run, through
Ray (the transport vLLM itself uses across nodes; one pip wheel for CPU, CUDA and ROCm hosts):
a Ray actor, owned by the trainer's first rank, that holds

    requests   what each rank needs next: (rank, epoch, seq, sample index, token ids), in order
    results    per rank, the states the producers made, handed out in the rank's request order
               (several producers, data parallel, finish out of order), a rank's `take` waiting
               until its next sample is there
    reserved   per rank, the tokens handed to producers or held for it, at most `capacity_tokens`:
               back-pressure, never growth. It is applied when work is handed out, not when it
               is delivered: a producer is never given a request whose result would not fit
               (the sample the rank needs next always fits), so a delivery never waits, and one
               rank's full buffer never holds back another rank's work (with several ranks in
               one DDP step, a producer waiting to deliver to a full rank while the rank it
               waits on starves would deadlock)
    status     each producer's last report (its engine, tokens/s, the time it waited for work
               that fits) and when it came, and their sum

The actor is not detached: it dies with the trainer that made it, and a producer whose next
call fails with RayActorError stops (a trainer that dies stops its producers). Delivery is
at most once: a rank killed inside `take` loses that item, and resumes from its checkpoint.
One machine and several use the same code: a local cluster (`ray.init()` in the trainer) or
one the user started (`ray start --head` / `--address`, `online.address`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from pathlib import Path

import ray
from ray._raylet import AuthenticationTokenLoader, Config  # what ray.init calls to turn token auth on
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainer.errors import DraftsmithError

NAMESPACE = "draftsmith"
CLOSED = "closed"  # what `take` answers, with the reason, once the channel is closed
PROBE_S = 3.0  # how long the cluster at online.address may take to answer a TCP connect


@ray.remote(num_cpus=0, max_concurrency=256)
class Channel:
    def __init__(self, ranks: int, capacity_tokens: int):
        self.requests: deque = deque()
        self.results: list[dict] = [{} for _ in range(ranks)]  # seq -> (item, tokens)
        self.expected = [0] * ranks  # the seq each rank takes next
        self.held = [0] * ranks  # tokens each rank's buffer holds
        self.reserved = [0] * ranks  # tokens handed out for each rank and not yet taken (held included)
        self.peak = [0] * ranks  # the most `reserved` has been: at most the capacity, or one sample
        self.capacity = capacity_tokens
        self.epoch = [0] * ranks  # what each rank takes now: results of other epochs are dropped
        self.cond = asyncio.Condition()
        self.closed, self.why = False, None
        self.producers: dict = {}  # pid -> (its last report, when it came)

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
            self.held[rank] = self.reserved[rank] = 0
            self.cond.notify_all()

    def _fits(self, request) -> bool:
        rank, _, seq, _, ids = request
        return seq == self.expected[rank] or self.reserved[rank] + len(ids) <= self.capacity

    def _ready(self) -> bool:
        """Some rank's oldest request (a rank's requests go out in its order) fits."""
        seen = set()
        for r in self.requests:
            if r[0] not in seen:
                if r[1] != self.epoch[r[0]] or self._fits(r):
                    return True
                seen.add(r[0])
        return False

    async def next_requests(self, most: int, timeout: float):
        """Up to `most` requests that fit their rank's buffer, each rank's in its order, oldest
        first ([] after `timeout` seconds without one); None once closed."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.closed or self._ready()), timeout)
            except asyncio.TimeoutError:
                return []
            if self.closed:
                return None
            picked, held_back, kept = [], set(), deque()
            for r in self.requests:
                rank, epoch = r[0], r[1]
                if epoch != self.epoch[rank]:
                    continue  # asked in an epoch the rank has left: dropped
                if len(picked) < most and rank not in held_back and self._fits(r):
                    picked.append(r)
                    self.reserved[rank] += len(r[4])
                    self.peak[rank] = max(self.peak[rank], self.reserved[rank])
                else:
                    held_back.add(rank)  # nothing of this rank goes out past one held back
                    kept.append(r)
            self.requests = kept
            return picked

    async def deliver(self, rank: int, epoch: int, seq: int, item: dict, tokens: int):
        """Hand `rank` the states of its request `seq` (room was reserved when it was handed
        out: this never waits). True when delivered (or dropped: another epoch), None once closed."""
        async with self.cond:
            if self.closed:
                return None
            if epoch == self.epoch[rank]:
                self.results[rank][seq] = (item, tokens)
                self.held[rank] += tokens
                self.cond.notify_all()
            return True

    async def take(self, rank: int, timeout: float):
        """The states `rank` needs next (its request order), None after `timeout` seconds, or once
        the channel is closed (CLOSED, why)."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(
                    lambda: self.closed or self.expected[rank] in self.results[rank]), timeout)
            except asyncio.TimeoutError:
                return None
            if self.closed:
                return CLOSED, self.why
            item, tokens = self.results[rank].pop(self.expected[rank])
            self.expected[rank] += 1
            self.held[rank] -= tokens
            self.reserved[rank] -= tokens
            self.cond.notify_all()
            return item

    def report(self, stats: dict) -> None:
        self.producers[stats.get("pid", 0)] = (stats, time.time())

    def status(self) -> dict:
        """The producers together (tokens/s summed, the time they waited for work that fits as a
        share of their busy time), each one's own report, and what the buffers hold."""
        reports = [r for r, _ in self.producers.values()]
        together = {}
        if reports:
            compute = sum(r.get("compute_s", 0.0) for r in reports)
            blocked = sum(r.get("blocked_s", 0.0) for r in reports)
            together = {"producers": len(reports), "tokens": sum(r.get("tokens", 0) for r in reports),
                        "tokens_per_s": sum(r.get("tokens_per_s", 0.0) for r in reports),
                        "blocked_fraction": blocked / (compute + blocked) if compute + blocked else 0.0}
        last = max((when for _, when in self.producers.values()), default=None)
        return {"producer": together, "producers": reports,
                "since_report_s": None if last is None else time.time() - last,
                "held_tokens": list(self.held), "reserved_tokens": list(self.reserved), "peak_tokens": list(self.peak),
                "node": ray.get_runtime_context().get_node_id(),
                "requests": len(self.requests)}

    async def close(self, why: str | None = None) -> None:
        """Every rank's `take` and every producer's next call end now; `why` (the first one given) is
        the line each rank ends with (None: the run ended, or its first rank did)."""
        async with self.cond:
            self.closed = True
            self.why = self.why or why
            self.cond.notify_all()


def join_cluster(address: str | None) -> str:
    """Join the Ray cluster at `address` ("auto": the one `ray start` made on this machine), or
    with None start one here; returns its address, for a producer to join. A cluster that does
    not answer is one line within seconds (Ray itself retries for minutes, saying little)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        if address:
            probe_cluster(address)
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
            except ConnectionError as err:  # "auto" with no cluster on this machine
                raise DraftsmithError(f"online.address={address}: no Ray cluster to join ({first_line(err)}); start "
                                      "one (`ray start --head`) or set online.address=null to start one here") from None
        else:
            ray.init(num_cpus=1, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


def cluster_auth() -> dict[str, str]:
    """What another process needs to join the cluster this one joined: Ray's token where the
    cluster checks one (a cluster `ray.init` starts does, Ray 2.60: RAY_AUTH_MODE=token, its token
    in ~/.ray/auth_token; a process joining by address sends it only when told to), else {}.
    As environment variables, which Ray reads (RAY_AUTH_MODE, RAY_AUTH_TOKEN)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN")
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        token = path.read_text().strip() if path.is_file() else None
    return {"RAY_AUTH_MODE": "token", **({"RAY_AUTH_TOKEN": token} if token else {})}


def use_auth(auth: dict[str, str]) -> None:
    """Join clusters with `auth` (cluster_auth's, from the first rank) from now on: set in this
    process's environment, and Ray's cached view of it refreshed, as ray.init does when it turns
    token auth on for a cluster it starts (Ray 2.60 caches RAY_AUTH_MODE and the token)."""
    if not auth:
        return
    os.environ.update(auth)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def open_channel(name: str, ranks: int, capacity_tokens: int):
    """The run's channel (made by the first rank; the handle must be kept: Ray collects an
    actor nobody holds), on the first rank's own Ray node: the ranks' buffers live beside the
    trainer, and the states cross from a producer's node once, through the object store."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Channel.options(name=name, namespace=NAMESPACE, scheduling_strategy=here).remote(ranks, capacity_tokens)


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


def probe_cluster(address: str, timeout: float = PROBE_S) -> None:
    """One line unless something accepts a TCP connection at `address` (host:port, ray://host:port;
    Ray's default port 6379 when none is given) within `timeout` seconds. "auto" is looked up by Ray."""
    if address == "auto":
        return
    where = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = where.rpartition(":")
    if not sep or "]" in port:  # no port (an IPv6 address in brackets without one)
        host, port = where, "6379"
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as err:
        why = "no answer" if isinstance(err, TimeoutError) else err.strerror or str(err)
        raise DraftsmithError(f"online.address={address}: no Ray cluster answers at {host}:{port} within {timeout:g} s "
                              f"({why}); start one there (`ray start --head --port={port}`), check the address, or "
                              "set online.address=null to start one on this machine") from None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
