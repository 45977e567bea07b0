"""Where an online run's hidden states come from. A source hands the trainer, sample by sample
and in the order the data loader asks for them, exactly what a capture would have stored
(trainer/data/shards.py): input_ids, loss_mask, the stored aux_hidden_states [T, L*H] and
last_hidden_state [T, H] (rounded to the store dtype, float8 with its scales), target_argmax
[T]. Nothing is written whole: a source holds at most `buffer_tokens` tokens of states and
drops each sample once taken.

    HFSource       the target in this process (transformers), for targets that fit beside the draft
    ChannelSource  a producer elsewhere (vLLM in its own environment and devices, on this machine or
                   another) through the run's Ray channel (trainer/online/channel.py)
    CachedSource   either, with the first `cache_tokens` tokens' states kept on local disk for
                   later epochs (they re-run the target for the rest)

The order is the epoch's plan: the sample indices this rank's data loader yields, read from
its (seeded) batch sampler before the epoch starts (`epoch_plan`), from the position a resumed
run restarts at.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch
from safetensors.torch import load_file
from torch.utils.data import Dataset

from trainer.capture import sample_states, token_budget_batches
from trainer.data.collate import PreparedSamples
from trainer.data.wire import decode
from trainer.errors import DraftsmithError
from trainer.io import atomic_save_safetensors
from trainer.online.channel import CLOSED


def epoch_plan(loader, epoch: int, skip_batches: int) -> tuple[list[int], int]:
    """(the sample indices `loader` yields in `epoch` on this rank, in order; the position of the
    first one after `skip_batches` batches). Reading the batch sampler draws no data, and the
    seeded sampler gives the same order again once the epoch is set back."""
    loader.set_epoch(epoch)
    batches = list(loader.batch_sampler)
    loader.set_epoch(epoch)  # the sampler counts an epoch per pass: set it back for the real one
    return [i for b in batches for i in b], sum(len(b) for b in batches[:skip_batches])


@dataclass
class SourceStats:
    """What the run log reports: the producer's tokens and seconds at work, and how long the
    trainer waited for states (the rest of its time it trained)."""

    tokens: int = 0
    produce_s: float = 0.0
    wait_s: float = 0.0
    producer: dict = field(default_factory=dict)  # separate producers' reports, together
    producers: list = field(default_factory=list)  # ... and each one's own
    channel: dict = field(default_factory=dict)  # where the run's channel is, the most each rank's buffer held

    def line(self, train_s: float) -> dict:
        rate = self.producer.get("tokens_per_s") or (self.tokens / self.produce_s if self.produce_s else 0.0)
        waited = self.wait_s / train_s if train_s else 0.0
        blocked = self.producer.get("blocked_fraction")
        bound = "producer-bound" if waited > 0.2 else \
            "trainer-bound" if blocked is None or blocked > 0.2 else "balanced"
        blocked_s = sum(p.get("blocked_s", 0.0) for p in self.producers)
        return {"producer_tokens_per_s": rate, "trainer_waited": waited, "producer_blocked": blocked, "bound": bound,
                "tokens_received": self.tokens, "trainer_wait_s": self.wait_s,  # the seconds each side waited
                **({"producer_blocked_s": blocked_s} if self.producers else {}), **self.channel,
                **({"producers": [{k: p.get(k) for k in ("pid", "node", "ip", "tokens", "tokens_per_s",
                                                         "blocked_fraction", "blocked_s") if k in p}
                                  for p in self.producers]} if self.producers else {})}


class StreamedSamples(Dataset):
    """The prepared samples (token ids, loss mask) with their states from `source`."""

    def __init__(self, prepared: PreparedSamples, source):
        self.prepared, self.source = prepared, source

    def __len__(self) -> int:
        return len(self.prepared)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.source.take(i)


class HFSource:
    """The target in this process. The epoch's plan is cut into windows of at most `buffer_tokens`
    tokens (from its start: the same windows however the run was interrupted); a window is made
    when its first sample is asked for, in token-budget batches of `max_tokens_per_batch` padded
    tokens, as capture makes a shard's. (A sample's states depend on its batch by float
    rounding; with batches of one sample, max_tokens_per_batch=1, they are bitwise a capture's
    made the same way.)"""

    def __init__(self, target, prepared: PreparedSamples, layer_ids: list[int], store_dtype: str,
                 max_tokens_per_batch: int, buffer_tokens: int):
        self.target, self.prepared, self.layer_ids = target, prepared, list(layer_ids)
        self.store_dtype, self.max_tokens, self.capacity = store_dtype, max_tokens_per_batch, buffer_tokens
        self.pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
        self.stats = SourceStats()
        self.plan, self.windows, self.held, self.next = [], [], {}, 0

    def begin(self, plan: list[int], start: int) -> None:
        self.plan, self.held, self.next = plan, {}, start
        self.windows, w, tokens = [], [], 0  # [(first, end)] positions of the plan
        for p, i in enumerate(plan):
            n = len(self.prepared[i]["input_ids"])
            if w and tokens + n > self.capacity:
                self.windows.append((w[0], w[-1] + 1))
                w, tokens = [], 0
            w.append(p)
            tokens += n
        if w:
            self.windows.append((w[0], w[-1] + 1))

    def take(self, i: int) -> dict[str, torch.Tensor]:
        p = self.next
        if p >= len(self.plan) or self.plan[p] != i:
            raise DraftsmithError(f"online: the data loader asked for sample {i}, the plan has "
                                  f"{self.plan[p] if p < len(self.plan) else 'none'} at position {p}")
        if p not in self.held:
            t0 = time.perf_counter()
            self._make(next(w for w in self.windows if w[0] <= p < w[1]))
            self.stats.produce_s += time.perf_counter() - t0
            self.stats.wait_s += time.perf_counter() - t0  # the trainer waits for its own target
        self.next = p + 1
        return self.held.pop(p)

    def _make(self, window: tuple[int, int]) -> None:
        first, end = window
        positions = list(range(first, end))
        rows = [self.prepared[self.plan[p]] for p in positions]
        for batch in token_budget_batches([len(r["input_ids"]) for r in rows], self.max_tokens):
            made = sample_states(self.target, [rows[k]["input_ids"].tolist() for k in batch], self.pad,
                                 self.layer_ids, self.store_dtype,
                                 samples=[self.plan[positions[k]] for k in batch])  # prepared sample indices
            for k, states in zip(batch, made):
                T = len(rows[k]["input_ids"])
                if positions[k] >= self.next:  # a resumed run's window starts before its first sample
                    self.held[positions[k]] = {**rows[k], **states}
                self.stats.tokens += T

    def close(self) -> None:
        self.held = {}


@dataclass
class Watch:
    """What a rank knows of the producers it takes from. `describe()`: them, with their logs;
    `todo()`: what to run after a failure, keeping what the line names (called first); `alive()`:
    on the rank that started them, whether every one still runs (None on the others: the channel
    tells them)."""

    describe: Callable[[], str]
    todo: Callable[[], str]
    alive: Callable[[], bool] | None = None


class ChannelSource:
    """States from a producer through the run's channel: this rank asks for the epoch's plan in
    order, a window of `buffer_tokens` tokens ahead of what it has taken, and takes each sample
    in turn. A producer that hands this rank nothing for `timeout_s` seconds (`start_timeout_s`
    until its first sample: the engine's start) ends the run in one line naming it; so does one
    that dies: the rank that started it watches it (a thread, whatever that rank is doing) and
    closes the channel with that line, and every rank's `take` ends with it within a second. A
    rank that fails closes the channel with its line too. The run's checkpoints stay, to resume."""

    POLL_S = 1.0  # the trainer checks the channel (and the producer's life) at least this often while it waits

    def __init__(self, channel, rank: int, prepared: PreparedSamples, buffer_tokens: int, timeout_s: float,
                 start_timeout_s: float, watch: Watch):
        self.channel, self.rank, self.prepared, self.watch = channel, rank, prepared, watch
        self.capacity, self.timeout_s, self.start_timeout_s = buffer_tokens, timeout_s, start_timeout_s
        self.stats = SourceStats()
        self.plan, self.epoch, self.next, self.asked, self.received = [], -1, 0, 0, 0
        self.stop = threading.Event()
        self.watcher = None
        if watch.alive is not None:
            self.watcher = threading.Thread(target=self._watch, name="draftsmith-online-watch", daemon=True)
            self.watcher.start()

    def _watch(self) -> None:
        """The rank that started the producers: one that dies closes the channel with the line
        every rank ends with."""
        while not self.stop.wait(self.POLL_S):
            if not self.watch.alive():
                self._close(self._line("died"))
                return

    def _line(self, what: str) -> str:
        todo = self.watch.todo()  # first: it may keep the log the line names somewhere that stays
        return f"online: {self.watch.describe()} {what}; {todo}"

    def _close(self, why: str | None) -> None:
        try:
            ray.get(self.channel.close.remote(why), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            pass

    def _fail(self, line: str) -> DraftsmithError:
        self._close(line)  # the other ranks end with this rank's line
        return DraftsmithError(line)

    def begin(self, plan: list[int], start: int) -> None:
        self.plan, self.next, self.asked = plan, start, start
        self.epoch += 1
        ray.get(self.channel.reset.remote(self.rank, self.epoch, start))
        self._ask()

    def _ask(self) -> None:
        """Keep the producer `buffer_tokens` tokens (and at least one sample) ahead of what was taken."""
        ahead = sum(len(self.prepared[self.plan[p]]["input_ids"]) for p in range(self.next, self.asked))
        items = []
        while self.asked < len(self.plan) and (ahead < self.capacity or self.asked == self.next):
            ids = self.prepared[self.plan[self.asked]]["input_ids"]
            items.append((self.asked, self.plan[self.asked], ids.tolist()))
            ahead += len(ids)
            self.asked += 1
        if items:
            ray.get(self.channel.request.remote(self.rank, self.epoch, items))

    def take(self, i: int) -> dict[str, torch.Tensor]:
        p = self.next
        if p >= len(self.plan) or self.plan[p] != i:
            raise DraftsmithError(f"online: the data loader asked for sample {i}, the plan has "
                                  f"{self.plan[p] if p < len(self.plan) else 'none'} at position {p}")
        self._ask()
        t0 = time.perf_counter()
        while True:
            try:
                item = ray.get(self.channel.take.remote(self.rank, self.POLL_S))
            except ray.exceptions.RayError as err:  # the actor went with the first rank
                raise DraftsmithError(f"online: the run's channel is gone ({type(err).__name__}): the first trainer "
                                      "rank ended; its error says why and what to run") from None
            if isinstance(item, (tuple, list)) and item and item[0] == CLOSED:
                raise DraftsmithError(item[1] or "online: the run's channel was closed: another trainer rank ended; "
                                      "its error says why and what to run")
            if item is not None:
                break
            waited = time.perf_counter() - t0
            if not self.received and waited > self.start_timeout_s:
                raise self._fail(self._line(
                    f"handed no first states for {waited:.0f} s (online.start_timeout_s={self.start_timeout_s:g}: "
                    "the engine's start and first batch; see its log, or raise it for a target that loads slower)"))
            if self.received and waited > self.timeout_s:
                raise self._fail(self._line(
                    f"handed no states for {waited:.0f} s (online.timeout_s={self.timeout_s:g})"))
        self.stats.wait_s += time.perf_counter() - t0
        self.received += 1
        seq, index = item.pop("seq"), item.pop("index")
        if (seq, index) != (p, i):
            raise self._fail(f"online: {self.watch.describe()} handed sample {index} at position {seq}, the trainer "
                             f"expected {i} at {p}")
        sample = decode(item)
        self.stats.tokens += sample["input_ids"].numel()
        self.next = p + 1
        return {**self.prepared[i], **sample}

    def refresh(self) -> None:
        """The producers' last reports (together, and each one's), for the run log."""
        try:
            status = ray.get(self.channel.status.remote(), timeout=10)
            self.stats.producer, self.stats.producers = status["producer"], status["producers"]
            self.stats.channel = {"channel_node": status["node"], "buffer_peak_tokens": status["peak_tokens"]}
        except (ray.exceptions.RayError, TimeoutError):
            pass

    def close(self) -> None:
        """The watcher first (a producer that ends because the channel closed did not fail), then the channel."""
        self.stop.set()
        if self.watcher is not None and self.watcher is not threading.current_thread():
            self.watcher.join(timeout=30)
        self._close(None)


class CachedSource:
    """`online.cache_tokens`: the first samples a run takes, up to that many tokens, kept on local
    disk (`folder`, safetensors a sample) as they are taken; a later epoch reads those from
    there and asks `inner` only for the rest. The cache lives while the run does (a resumed run
    starts a new one) and is removed when it ends."""

    def __init__(self, inner, folder, capacity_tokens: int):
        self.inner, self.folder, self.capacity = inner, folder, capacity_tokens
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.cached, self.held = set(), 0
        self.stats = inner.stats

    def begin(self, plan: list[int], start: int) -> None:
        self.inner.begin([i for i in plan[start:] if i not in self.cached], 0)

    def take(self, i: int) -> dict[str, torch.Tensor]:
        if i in self.cached:
            return load_file(self.folder / f"{i}.safetensors")
        sample = self.inner.take(i)
        n = sample["input_ids"].numel()
        if self.held + n <= self.capacity:
            atomic_save_safetensors(self.folder / f"{i}.safetensors", {k: v.contiguous() for k, v in sample.items()})
            self.cached.add(i)
            self.held += n
        return sample

    def refresh(self) -> None:
        if hasattr(self.inner, "refresh"):
            self.inner.refresh()

    def close(self) -> None:
        self.inner.close()
        shutil.rmtree(self.folder, ignore_errors=True)
