"""The hf producers of an online run placed through Ray: the target (transformers) in Ray actors,
`online.data_parallel_size` of them, each on a node that has `online.producer_resources` (a
resource a node was started with, `ray start --resources='{"producer_node": 1}'`: the user's
placement), on this machine or another. Each takes the oldest requests that fit their ranks'
buffers from the run's channel (channel.py), computes their states as HFSource does (token-budget
batches of `online.max_tokens_per_batch` padded tokens; 1: every sample alone, and the states are
then bitwise those of the target in the trainer's own process) and delivers each to its rank:
the states cross from the producer's node to the channel's (the first rank's) through Ray's
object store.

The actors are owned by the first trainer rank: Ray ends them when it goes (a rank that dies
ends the launch, and the first rank with it), so nothing holds a device past the run. The first
rank watches them (`alive`): a producer whose node leaves the cluster (its raylet killed, the
machine lost) ends the run in one line naming the node, the checkpoints kept to resume.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import ray
import torch

from trainer.capture import sample_states, token_budget_batches
from trainer.data.wire import encode
from trainer.errors import DraftsmithError
from trainer.online.channel import NAMESPACE, first_line
from trainer.target import load_target

# tests: a producer that hands no rank the samples at this position of their first epoch's plan or
# later (it sleeps instead), so that a test can take its node away mid-run at a known point
STALL_AFTER_SAMPLES = "DRAFTSMITH_FAULT_PRODUCER_STALL_AFTER_SAMPLES"
CHUNK = 8  # requests a producer takes from the channel at once (each rank's buffer bounds them)


NODE_LEFT = "its node left the Ray cluster: its raylet died or the machine went"


def actor_where(index: int) -> dict:
    """Where the calling Ray actor runs, for lines that name it: its index, node, IP, host and pid."""
    ctx = ray.get_runtime_context()
    return {"index": index, "node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "host": os.uname().nodename, "pid": os.getpid()}


def check_same_target(spec: str, found: str, digest: str, ip: str) -> None:
    """One line unless the target a producer resolved on its node (sha256 `found`) is the trainer's."""
    if found != digest:
        raise DraftsmithError(f"target '{spec}' on node {ip} is not the trainer's (sha256 {found[:12]} != "
                              f"{digest[:12]}); give every node the same files")


def actor_lost(node: str, err: Exception) -> str:
    """Why an actor on `node` is gone: its node left the cluster, or it died on a live node."""
    gone = not any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())
    return NODE_LEFT if gone else f"its actor died: {first_line(err)}"


def node_back(resources: dict, address: str) -> str:
    """What to do beyond resuming when a producer's node is lost: bring one with its resources back."""
    return (f" once a node with {resources_arg(resources)} is in the cluster again "
            f"(`ray start --address={address} --resources='{resources_arg(resources)}'` on it)")


@ray.remote(max_concurrency=2)  # `run` and a `where` while it runs
class HFProducer:
    def __init__(self, index: int):
        self.index = index

    def where(self) -> dict:
        return actor_where(self.index)

    def run(self, channel_name: str, target: str, digest: str, layer_ids: list[int], store_dtype: str,
            max_tokens: int, stall_after: int = 0) -> dict:
        """Make states for the channel's requests until it closes; returns this producer's stats."""
        t0 = time.perf_counter()
        on_gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        model = load_target(target, "bfloat16" if on_gpu else "float32", "cuda" if on_gpu else "cpu")
        check_same_target(target, model.content_hash, digest, self.where()["ip"])
        pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
        channel = ray.get_actor(channel_name, namespace=NAMESPACE)
        stats = {"engine": "hf", "engine_start_s": time.perf_counter() - t0, "tokens": 0, "samples": 0,
                 "compute_s": 0.0, "blocked_s": 0.0, **self.where()}

        def report() -> None:
            busy = stats["compute_s"] + stats["blocked_s"]
            stats["tokens_per_s"] = stats["tokens"] / stats["compute_s"] if stats["compute_s"] else 0.0
            stats["blocked_fraction"] = stats["blocked_s"] / busy if busy else 0.0
            channel.report.remote(dict(stats))

        report()
        stalled = False
        try:
            while True:
                t2 = time.perf_counter()
                requests = ray.get(channel.next_requests.remote(CHUNK, 1.0))
                if requests is None:  # closed: the run is over
                    break
                if not requests:  # nothing asked fits the ranks' buffers: the trainer is the slower side
                    stats["blocked_s"] += time.perf_counter() - t2
                    report()
                    continue
                for batch in token_budget_batches([len(r[4]) for r in requests], max_tokens):
                    t1 = time.perf_counter()
                    picked = [requests[k] for k in batch]
                    made = sample_states(model, [r[4] for r in picked], pad, layer_ids, store_dtype,
                                         samples=[r[3] for r in picked])
                    stats["compute_s"] += time.perf_counter() - t1
                    for (rank, epoch, seq, index, ids), states in zip(picked, made):
                        T = len(ids)
                        if stall_after and epoch == 0 and seq >= stall_after:
                            stalled = True
                            continue
                        sample = {"input_ids": torch.as_tensor(ids, dtype=torch.long), **states}
                        if ray.get(channel.deliver.remote(rank, epoch, seq, {**encode(sample), "seq": seq,
                                                                             "index": index}, T)) is None:
                            return stats  # closed
                        stats["tokens"] += T
                        stats["samples"] += 1
                report()
                if stalled:
                    time.sleep(3600)  # tests: a producer that stops here, its node taken away
        except ray.exceptions.RayActorError:
            pass  # the channel went with the first rank: nothing is left to produce for
        return stats


@dataclass
class HFProducers:
    """The first rank's handle on the run's hf producers (the actors, their `run` calls, where each runs)."""

    actors: list
    runs: list
    where: list[dict]
    resources: dict | None
    address: str
    stopped: bool = False
    ended: dict = field(default_factory=dict)  # index -> why it ended (filled by `describe`)

    def alive(self) -> bool:
        """Every producer still runs (a producer returns only once the channel is closed)."""
        ready, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        return not ready

    def _why(self, i: int) -> str:
        if i not in self.ended:
            try:
                ray.get(self.runs[i], timeout=5)
                self.ended[i] = "it stopped"
            except ray.exceptions.RayActorError as err:
                self.ended[i] = actor_lost(self.where[i]["node"], err)
            except ray.exceptions.RayTaskError as err:
                self.ended[i] = first_line(err.cause if err.cause is not None else err)
            except Exception as err:  # noqa: BLE001 (one line, whatever Ray raised)
                self.ended[i] = f"{type(err).__name__}: {first_line(err)}"
        return self.ended[i]

    def describe(self) -> str:
        ready, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if ready:
            i = self.runs.index(ready[0])
            return f"the hf producer {i} on node {node_line(self.where[i], self._why(i))}"
        nodes = ", ".join(node_line(w) for w in self.where)
        return f"the hf producer{'s' if len(self.where) > 1 else ''} on node {nodes}"

    def todo(self) -> str:
        """What to do beyond resuming: a node lost must come back (or another with the resources join)."""
        ready, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        lost = [i for i, run in enumerate(self.runs) if run in ready and self._why(i) == NODE_LEFT]
        return node_back(self.resources, self.address) if lost and self.resources else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """The producers end by themselves once the channel is closed; after `grace_s` seconds they
        are killed, whatever they hold."""
        if self.stopped:
            return
        self.stopped = True
        ray.wait(self.runs, num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 (gone already)
                pass


def node_line(where: dict, why: str = "") -> str:
    """`IP (host H, Ray node N, pid P[; why])`: the node a producer runs on, for a line."""
    why = f"; {why}" if why else ""
    return f"{where['ip']} (host {where['host']}, Ray node {where['node'][:12]}, pid {where['pid']}{why})"


def resources_arg(resources: dict) -> str:
    return json.dumps({k: (int(v) if float(v).is_integer() else v) for k, v in resources.items()})


def check_resources(resources: dict | None, producers: int, address: str) -> None:
    """One line unless the cluster's live nodes offer `producers` x `resources` in all (a producer
    asking for resources no node has would wait forever, Ray saying nothing)."""
    if not resources:
        return
    have = ray.cluster_resources()
    short = {k: v * producers for k, v in resources.items() if have.get(k, 0.0) < v * producers}
    if short:
        raise DraftsmithError(
            f"online.producer_resources={resources_arg(resources)}: the Ray cluster at {address} offers "
            f"{', '.join(f'{k}={have.get(k, 0.0):g}' for k in short)} for {producers} producer(s) needing "
            f"{', '.join(f'{k}={v:g}' for k, v in short.items())}; start a node with them "
            f"(`ray start --address={address} --resources='{resources_arg(resources)}'`) or lower "
            "online.data_parallel_size")


def start_hf_producers(target, channel_name: str, layer_ids: list[int], online, address: str,
                       start_timeout_s: float) -> HFProducers:
    """`online.data_parallel_size` hf producers on nodes with `online.producer_resources`, each
    taking the run's channel's requests; returns once each has told where it runs."""
    resources = dict(online.producer_resources or {})
    check_resources(resources, online.data_parallel_size, address)
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    stall = int(os.environ.get(STALL_AFTER_SAMPLES, "0"))
    actors, runs = [], []
    for i in range(online.data_parallel_size):
        actor = HFProducer.options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                                   resources=custom or None, namespace=NAMESPACE).remote(i)
        actors.append(actor)
        runs.append(actor.run.remote(channel_name, target.spec, target.content_hash, list(layer_ids),
                                     online.store_dtype, online.max_tokens_per_batch, stall))
    try:
        where = ray.get([a.where.remote() for a in actors], timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for actor in actors:
            ray.kill(actor)
        raise DraftsmithError(f"online: the hf producers were not placed on the Ray cluster at {address} within "
                              f"{start_timeout_s:g} s (online.start_timeout_s); see `ray status` there") from None
    return HFProducers(actors, runs, where, resources or None, address)
