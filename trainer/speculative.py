"""The in-tree speculative decoder: draft -> verify (greedy | rejection sampling) -> accept.

One round: the draft proposes N tokens x_1..x_N with distributions q_1..q_N; the
target scores [pending, x_1..x_N] in one forward, giving p_1..p_{N+1}; tokens are
accepted left to right until the first rejection, where a token from the target's
residual distribution is placed; when all N are accepted, a bonus token is drawn
from p_{N+1}. Both caches then drop the rejected positions.

Rejection sampling (Leviathan et al., 2023, "Fast Inference from Transformers via
Speculative Decoding", Alg. 1; Chen et al., 2023): accept x with probability
min(1, p(x)/q(x)); on rejection sample from norm(max(0, p - q)). The output
distribution is exactly the target's. Greedy verification is its one-hot limit:
accept x iff x = argmax p, else place argmax p.

Rounds as vLLM counts them (vllm/v1/core/sched/scheduler.py, update_from_output): the
whole prompt is prefilled and the first output token is sampled from that prefill; the
first draft round starts after it, from that token. Every later step of a request is one
round: `num_drafts` += 1, `num_accepted_tokens` += the accepted count before any cut at
max_tokens or an end token (those are applied to the output afterwards), until the request
has finished. `DecodeStats` counts the same things, row-round for row-round.

Draft sampling (vLLM 0.32 `draft_sample_method`): "greedy" proposes the draft's argmax and
rejection sampling sees a one-hot q; "probabilistic" samples x ~ q with q = softmax(draft
logits / temperature), temperature only, as vLLM's draft sampler
(vllm/v1/spec_decode/llm_base_proposer.py in vLLM 0.32, compute_probs_and_sample_next_token) ignores
top-k/top-p for the draft. Either is lossless: the ratio test uses the target's processed p.

Batches: rows accept different numbers of tokens. Rejected slots become holes in
the attention mask (never attended; positions come from the mask), and the
trailing holes common to all rows are cropped from the caches, so with batch 1
every rollback is an exact crop.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from trainer.errors import ConfigError

# How a draft picks its proposals under sampling (vLLM 0.32 `draft_sample_method`):
# "greedy" (vLLM's default: the draft's argmax, a one-hot q in rejection sampling) or
# "probabilistic" (x ~ q, the draft's processed distribution as q). Either way lossless.
DRAFT_SAMPLING = ("greedy", "probabilistic")


def check_draft_sampling(name: str) -> str:
    if name not in DRAFT_SAMPLING:
        raise ConfigError(f"draft_sampling '{name}' is not one of {', '.join(DRAFT_SAMPLING)}")
    return name


def check_num_draft_tokens(n: int, most: int | None, what: str) -> None:
    """N (vLLM's num_speculative_tokens) must fit what the draft proposes in one round (a
    block draft's block). One line naming both, checked by generate() and at export."""
    if most is not None and n > most:
        raise ConfigError(f"num_draft_tokens={n} is more than {what} proposes ({most}); use at most {most}")


def positions_from_mask(mask: torch.Tensor, last: int | None = None) -> torch.Tensor:
    """Positions of committed slots from a [B, S] mask (holes and left padding skipped): the
    count of committed slots before each, [B, S] or its `last` columns."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos if last is None else pos[:, -last:]


def trailing_holes(keep: torch.Tensor) -> int:
    """Slots rejected at the end of every row of keep [B, n]: what can be cropped from a cache."""
    return int((~keep.bool()).long().flip(-1).cumprod(-1).sum(-1).min())


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution a sampler draws from: temperature, then top-k, then top-p. [..., V] -> [..., V]."""
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= s.top_p  # keep the smallest prefix with mass >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


class DraftSampler:
    """How a proposer turns logits over its draft vocabulary [..., Vd] into proposals, as vLLM
    does: greedy (the argmax, mapped to target ids through `target_ids` [Vd]; q None =
    one-hot) or, with draft_sampling "probabilistic" and a sampled target, x ~ q =
    softmax(logits / temperature) scattered into the target vocabulary (-inf elsewhere:
    vLLM's compute_logits with d2t). Seeded: the same seed, the same proposals."""

    def __init__(self, draft, draft_sampling: str = "greedy", seed: int = 0):
        self.draft_sampling = check_draft_sampling(draft_sampling)
        self.target_ids = draft.draft_to_target()  # [Vd]
        self.vocab_size = draft.config.vocab_size
        self.generator = torch.Generator(device=self.target_ids.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [..., Vd] -> (x [...] target ids, q [..., V] or None)."""
        if self.draft_sampling != "probabilistic" or sampling.greedy:
            return self.target_ids[logits.argmax(-1)], None
        V = self.vocab_size
        full = logits.new_full((*logits.shape[:-1], V), float("-inf"))
        full[..., self.target_ids] = logits
        q = (full.float() / sampling.temperature).softmax(-1)  # [..., V]: temperature only, as vLLM's draft sampler
        x = torch.multinomial(q.reshape(-1, V), 1, generator=self.generator).view(logits.shape[:-1])
        return x, q


def verify(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, greedy: bool,
           generator: torch.Generator | None = None,
           lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept/reject one round. p: [B, N+1, V] target; q: [B, N, V] draft; x: [B, N] proposed;
    lengths [B]: how many of a row's N tokens were proposed (None: all; the rest is padding,
    never accepted, and a row that had all its tokens accepted draws its bonus token after them).

    Returns (n_accepted [B], next_token [B]): the correction at the first rejection, or the bonus token.
    """
    B, N = x.shape
    rows = torch.arange(B, device=x.device)
    if greedy:
        accept = x == p[:, :N].argmax(-1)  # [B, N]
    else:
        px = p[:, :N].gather(-1, x[..., None])[..., 0]  # p(x_k)
        qx = q.gather(-1, x[..., None])[..., 0]  # q(x_k)
        u = torch.rand(B, N, generator=generator, device=x.device)
        accept = u * qx < px  # u < p/q, i.e. accept with probability min(1, p/q)
    if lengths is not None:
        accept &= torch.arange(N, device=x.device)[None] < lengths[:, None]
    n = accept.long().cumprod(-1).sum(-1)  # [B] accepted before the first rejection
    p_next = p[rows, n]  # [B, V]: p_{n+1}
    if greedy:
        return n, p_next.argmax(-1)
    q_next = torch.cat([q, q.new_zeros(B, 1, p.shape[-1])], 1)[rows, n]  # zero past the last draft: bonus from p
    if lengths is not None:
        q_next = q_next * (n < lengths)[:, None]  # past a short proposal's last token: the bonus, from p
    residual = (p_next - q_next).clamp(min=0)  # max(0, p - q)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)  # p == q exactly: any is fine
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, N]
    q: torch.Tensor | None = None  # [B, N, V] the draft's processed distributions; None: deterministic (one-hot)
    # [B] how many of each row's N tokens are proposed (None: all N). vLLM's n-gram proposes fewer, or none:
    # a row with none decodes one token and, as in vLLM, counts no draft round
    lengths: torch.Tensor | None = None


class Draft(Protocol):
    """What the decoder needs of a draft. `sequences` are the rows' committed tokens
    (prompt + generated, the pending token last); `aux` the target's aux hidden states
    for the positions it just processed ([B, T, L*H], None if the draft asked for none)."""

    aux_layer_ids: list[int]
    max_draft_tokens: int | None  # the largest N it proposes (None: any)
    parallel: bool  # proposes all N tokens in one forward (block drafts): its draft cost per round is flat in N

    def begin(self, sequences: list[list[int]], aux: torch.Tensor | None, mask: torch.Tensor) -> None: ...

    def propose(self, sequences: list[list[int]], n: int, sampling: Sampling) -> Proposal: ...

    def commit(self, sequences: list[list[int]], aux: torch.Tensor | None, keep: torch.Tensor) -> None: ...


class Prefills:
    """Prompt batches already prefilled by one target, kept so that several decodes of the same
    prompts (eval's plain and speculative decodes of a bucket) prefill once. The first decode of a
    batch runs the prefill with `aux_layer_ids` (the draft's layers: either decode can start from
    it) and keeps the cache, mask and output; a later decode starts from a copy of them and is
    charged the seconds that prefill took, so its tokens/s read as if it had prefilled alone. A
    decode whose draft reads other layers prefills as before."""

    def __init__(self, aux_layer_ids=()):
        self.aux_layer_ids = list(aux_layer_ids)
        self.kept: dict[tuple, tuple] = {}  # prompts -> (cache, mask, output, seconds)
        self.target = None
        self.reused = 0  # prefills handed out again

    def serves(self, target, aux_layer_ids) -> bool:
        if self.target is not None and self.target is not target:
            raise ValueError("one Prefills holds one target's prefills; make one per target")
        return not aux_layer_ids or list(aux_layer_ids) == self.aux_layer_ids


class TargetSession:
    """The target with its KV cache for a batch of rows (left-padded prompts)."""

    def __init__(self, target, aux_layer_ids=()):
        self.target, self.aux_layer_ids = target, list(aux_layer_ids)
        self.reused_s = 0.0  # the seconds of a kept prefill this session started from (else 0)

    def prefill(self, prompts: list[list[int]], prefills: Prefills | None = None):
        """The whole prompt of every row, as vLLM prefills it: returns the target's output over
        [B, P] (aux states of every position; logits of the last, which give the first token)."""
        if prefills is None or not prefills.serves(self.target, self.aux_layer_ids):
            return self._prefill(prompts, self.aux_layer_ids)
        key = tuple(map(tuple, prompts))
        if key not in prefills.kept:
            t0 = time.perf_counter()
            out = self._prefill(prompts, prefills.aux_layer_ids)
            prefills.target = self.target
            prefills.kept[key] = (copy.deepcopy(self.cache), self.mask.clone(), out, time.perf_counter() - t0)
            return out
        cache, mask, out, seconds = prefills.kept[key]
        self.cache, self.mask, self.reused_s = copy.deepcopy(cache), mask.clone(), seconds
        prefills.reused += 1
        return out

    def _prefill(self, prompts: list[list[int]], aux_layer_ids):
        dev = self.target.device
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=dev)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long, device=dev)  # [B, S] 1 = committed
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, device=dev)
            self.mask[r, width - len(p):] = 1
        self.cache = DynamicCache(config=self.target.model.config)
        # sliding-window layers (Gemma-3) keep only the window; recording the past lets every
        # rollback crop them exactly (transformers' DynamicSlidingWindowLayer.crop)
        self.cache.activate_past_recording()
        return self.target.forward(ids, self.mask, aux_layer_ids=aux_layer_ids, cache=self.cache,
                                   position_ids=positions_from_mask(self.mask, ids.shape[1]), logits_to_keep=1)

    def _run(self, ids, mask):
        return self.target.forward(ids, mask, aux_layer_ids=self.aux_layer_ids, cache=self.cache,
                                   position_ids=positions_from_mask(mask, ids.shape[1]))

    def verify(self, inputs: torch.Tensor):
        """Score inputs [B, n+1] (pending token + n draft tokens) after the committed cache."""
        self.mask = torch.cat([self.mask, torch.ones_like(inputs)], 1)
        return self._run(inputs, self.mask)

    def commit(self, keep: torch.Tensor) -> None:
        """keep [B, n+1]: which of the last verified slots stay. Rejected ones become holes;
        holes at the end of every row are cropped from the cache."""
        n1 = keep.shape[1]
        self.mask[:, -n1:] = keep.long()
        trailing = trailing_holes(keep)
        self.cache.crop(-trailing)  # transformers 5: crop(-n) removes n tokens (crop(0) trims sliding layers)
        if trailing:
            self.mask = self.mask[:, :-trailing]


@dataclass
class DecodeStats:
    """What a decode counts, as vLLM's spec-decode metrics count it (see the module docstring)."""

    num_draft_tokens: int
    iterations: int = 0  # decoder loop iterations after the prefill (one target forward each)
    rounds: int = 0  # row-rounds with a proposal: iterations x active rows that drafted (vLLM's num_drafts)
    drafted: int = 0  # draft tokens proposed in those rounds (vLLM's num_draft_tokens)
    accepted: int = 0  # draft tokens accepted (vLLM's num_accepted_tokens)
    accepted_at: list[int] = field(default_factory=list)  # rounds in which position k was accepted (cumulative)
    generated: int = 0
    prefill_s: float = 0.0  # the prompt forward, first token included (draft.begin counts as draft time)
    propose_s: float = 0.0  # draft.propose
    commit_s: float = 0.0  # draft.begin and draft.commit (the draft's share of each round's bookkeeping)
    verify_s: float = 0.0  # target forwards after the prefill, acceptance and cache rollback
    total_s: float = 0.0

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.num_draft_tokens

    @property
    def draft_s(self) -> float:
        return self.propose_s + self.commit_s

    @property
    def tau(self) -> float:
        """Mean accepted length, bonus token included (vLLM's "Mean acceptance length")."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def cumulative_acceptance(self) -> list[float]:
        """P(positions 1..k all accepted), per position k."""
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted_at]

    @property
    def conditional_acceptance(self) -> list[float]:
        """P(position k accepted | positions < k accepted)."""
        prev = [self.rounds] + self.accepted_at[:-1]
        return [a / b if b else 0.0 for a, b in zip(self.accepted_at, prev)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.total_s if self.total_s else 0.0

    def counts(self) -> dict:
        """vLLM's counter names (trainer/vllm/runners/vllm_generate.py reads the same from vLLM)."""
        return {"num_drafts": self.rounds, "num_accepted_tokens": self.accepted,
                "accepted_per_position": list(self.accepted_at)}

    def merge(self, other: DecodeStats) -> None:
        for f in ("iterations", "rounds", "drafted", "accepted", "generated", "prefill_s", "propose_s", "commit_s",
                  "verify_s", "total_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]


def _sample(p: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    """A token per row of processed probabilities p [B, V]."""
    return p.argmax(-1) if greedy else torch.multinomial(p, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(target, prompts: list[list[int]], max_new_tokens: int, draft: Draft | None = None,
             num_draft_tokens: int = 4, sampling: Sampling | None = None, eos_token_ids=(),
             seed: int = 0, prefills: Prefills | None = None) -> tuple[list[list[int]], DecodeStats]:
    """Speculative decoding (or plain autoregressive decoding when `draft` is None), round for
    round as vLLM runs it: the first token from the prefill, then one draft-verify round per
    step while a row is unfinished.

    Returns the generated tokens per row (eos included when produced) and the stats. With
    `prefills`, a batch prefilled before for another decode starts from that prefill (`Prefills`).
    """
    sampling = sampling or Sampling()
    N = num_draft_tokens if draft is not None else 0
    if draft is not None:
        check_num_draft_tokens(N, draft.max_draft_tokens, "this draft")
    if len(prompts) > 1 and getattr(target, "has_sliding_layers", False):
        # a hole left by a rejection would shift a sliding window by a slot: such targets decode
        # one row at a time, where every rollback is an exact crop
        outputs, stats = [], DecodeStats(num_draft_tokens=N)
        for r, prompt in enumerate(prompts):
            out, s = generate(target, [prompt], max_new_tokens, draft, num_draft_tokens, sampling, eos_token_ids,
                              seed + r, prefills)
            outputs += out
            stats.merge(s)
        return outputs, stats
    gen = torch.Generator(device=target.device).manual_seed(seed)
    stats = DecodeStats(num_draft_tokens=N)
    eos = set(eos_token_ids)
    B = len(prompts)
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * B

    def emit(r: int, tokens) -> None:
        for t in tokens:
            if done[r]:
                return
            new[r].append(t)
            done[r] = t in eos or len(new[r]) >= max_new_tokens

    t_start = time.perf_counter()
    session = TargetSession(target, draft.aux_layer_ids if draft is not None else ())
    out = session.prefill(prompts, prefills)
    pending = _sample(processed_probs(out.logits[:, -1], sampling), sampling.greedy, gen)  # [B] the first token
    for r in range(B):
        emit(r, [int(pending[r])])
    seqs = [list(p) + [int(pending[r])] for r, p in enumerate(prompts)]
    t1 = time.perf_counter()
    t_start -= session.reused_s  # a kept prefill is charged what it took
    stats.prefill_s += t1 - t_start
    if draft is not None:
        draft.begin(seqs, out.aux_hidden_states, session.mask)
        stats.commit_s += time.perf_counter() - t1
    while not all(done):
        t0 = time.perf_counter()
        if N:
            proposal = draft.propose(seqs, N, sampling)
            x = proposal.tokens.to(target.device)  # [B, N]
            q = proposal.q if proposal.q is not None else \
                torch.nn.functional.one_hot(x, target.vocab_size).float()
            lengths = proposal.lengths.to(x.device) if proposal.lengths is not None else None
            if lengths is not None:  # verify only as wide as the longest proposal (none: a plain decoding step)
                width = int(lengths.max())
                x, q = x[:, :width], q[:, :width]
        else:
            x = torch.zeros(B, 0, dtype=torch.long, device=target.device)
            q = torch.zeros(B, 0, target.vocab_size, device=target.device)
            lengths = None
        t1 = time.perf_counter()
        out = session.verify(torch.cat([pending[:, None], x], 1))  # [B, N+1]
        p = processed_probs(out.logits, sampling)  # [B, N+1, V]
        n, nxt = verify(p, q.to(p.device), x, sampling.greedy, gen, lengths)
        keep = torch.arange(x.shape[1] + 1, device=x.device)[None] <= n[:, None]  # pending + accepted stay
        session.commit(keep)
        t2 = time.perf_counter()
        for r in range(B):
            if done[r]:
                continue
            k = int(n[r])
            proposed = N if lengths is None else int(lengths[r])
            stats.rounds += proposed > 0  # a step without a proposal is no draft round (vLLM counts none)
            stats.drafted += proposed
            stats.accepted += k  # before any cut at max_new_tokens or an end token, as vLLM counts
            for j in range(k):
                stats.accepted_at[j] += 1
            emit(r, [*x[r, :k].tolist(), int(nxt[r])])
        for r in range(B):
            seqs[r] = seqs[r] + x[r, :int(n[r])].tolist() + [int(nxt[r])]
        pending = nxt
        if draft is not None:
            draft.commit(seqs, out.aux_hidden_states, keep)
        t3 = time.perf_counter()
        stats.iterations += 1
        stats.propose_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.commit_s += t3 - t2
    stats.generated = sum(len(t) for t in new)
    stats.total_s = time.perf_counter() - t_start
    return new, stats


class NGramDraft:
    """Prompt lookup (Saxena, 2023), as vLLM's `ngram` method proposes
    (vllm/v1/spec_decode/ngram_proposer.py in 0.32 and 0.33; vllm/v1/worker/gpu/spec_decode/ngram/ in
    0.34): the longest n-gram, n from
    `prompt_lookup_max` down to `prompt_lookup_min`, that ends the context and occurs earlier in
    it; of its occurrences the earliest; proposed: up to N tokens that followed it (fewer where
    the context ends first), and nothing without a match (vLLM then decodes one token and counts
    no draft). vLLM's defaults when neither is given: 5 and 5 (vllm/config/speculative.py).
    Needs no training: the baseline every draft must beat."""

    aux_layer_ids: list[int] = []
    max_draft_tokens: int | None = None
    parallel = False  # a lookup per token
    OPTIONS: tuple[str, ...] = ("prompt_lookup_min", "prompt_lookup_max")
    ABLATIONS: dict[str, dict] = {}

    def __init__(self, prompt_lookup_min: int = 5, prompt_lookup_max: int = 5):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}: the "
                              "n-gram baseline needs 1 <= prompt_lookup_min <= prompt_lookup_max (as vLLM)")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def speculative_config(self) -> dict:
        """What vLLM's --speculative-config needs to propose as this does (N added by the caller)."""
        return {"method": "ngram", "prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n}

    def begin(self, sequences, aux, mask) -> None:
        pass

    def commit(self, sequences, aux, keep) -> None:
        pass

    def propose(self, sequences, n: int, sampling: Sampling) -> Proposal:
        found = [self._lookup(seq, n) for seq in sequences]
        rows = [f + [0] * (n - len(f)) for f in found]  # padding, never accepted
        return Proposal(torch.tensor(rows, dtype=torch.long).view(len(rows), n),
                        lengths=torch.tensor([len(f) for f in found], dtype=torch.long))

    def _lookup(self, seq: list[int], n: int) -> list[int]:
        for size in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail = seq[-size:]
            for start in range(len(seq) - size):  # earliest first; the suffix itself excluded
                if seq[start:start + size] == tail:
                    return seq[start + size:start + size + n]
        return []


def measure(target, draft: Draft | None, prompts: list[list[int]], max_new_tokens: int, num_draft_tokens: int = 4,
            sampling: Sampling | None = None, eos_token_ids=(), batch_size: int = 1, seed: int = 0,
            progress: str | None = None, prefills: Prefills | None = None) -> DecodeStats:
    """Decode `prompts` in batches and merge the stats (None draft = autoregressive); `prefills`
    shares each batch's prefill with other decodes of the same batches."""
    stats = DecodeStats(num_draft_tokens if draft is not None else 0)
    starts = range(0, len(prompts), batch_size)
    for b in tqdm(starts, desc=progress, unit="batch", disable=progress is None, leave=False):
        _, s = generate(target, prompts[b:b + batch_size], max_new_tokens, draft, num_draft_tokens, sampling,
                        eos_token_ids, seed=seed + b, prefills=prefills)
        stats.merge(s)
    return stats


def measure_together(target, drafts: list[Draft | None], prompts: list[list[int]], max_new_tokens: int,
                     num_draft_tokens: int = 4, sampling: Sampling | None = None, eos_token_ids=(),
                     batch_size: int = 1, seed: int = 0, progress: str | None = None) -> list[DecodeStats]:
    """`measure` of each of `drafts` (None: without a draft) on the same prompts, batch by batch from
    one prefill of each batch (`Prefills`): their merged stats, each as `measure` gives it alone (same
    seeds, the prefill's seconds charged to every decode), at the cost of one prefill per batch
    instead of one per draft. The drafts read the same aux layers (a prefill keeps one set)."""
    layers = {tuple(d.aux_layer_ids) for d in drafts if d is not None and d.aux_layer_ids}
    if len(layers) > 1:
        raise ValueError(f"measure_together: drafts reading different aux layers {sorted(layers)}: measure apart")
    stats = [DecodeStats(num_draft_tokens if d is not None else 0) for d in drafts]
    for b in tqdm(range(0, len(prompts), batch_size), desc=progress, unit="batch", disable=progress is None,
                  leave=False):
        batch, shared = prompts[b:b + batch_size], Prefills(next(iter(layers), ()))
        for st, draft in zip(stats, drafts):
            st.merge(generate(target, batch, max_new_tokens, draft, num_draft_tokens, sampling, eos_token_ids,
                              seed=seed + b, prefills=shared)[1])
    return stats


def measure_with_baseline(target, draft: Draft, prompts: list[list[int]], max_new_tokens: int,
                          num_draft_tokens: int = 4, **options) -> tuple[DecodeStats, DecodeStats]:
    """`measure` without a draft and with `draft` from one prefill of each batch: (plain, speculative)."""
    plain, spec = measure_together(target, [None, draft], prompts, max_new_tokens, num_draft_tokens, **options)
    return plain, spec
