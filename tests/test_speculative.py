"""Invariants of the in-tree speculative decoder, with drafts right or wrong by construction."""

import math
from collections import Counter

import pytest
import torch

import trainer.speculative as spec
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from trainer.drafts.eagle3 import Eagle3Config, Eagle3Draft, Eagle3Proposer
from trainer.speculative import NGramDraft, Proposal, Sampling, generate
from trainer.target import Target


def tiny_target(vocab=None, seed=0):
    tok = make_tiny_tokenizer()
    m = make_tiny_model(vocab or len(tok), seed=seed)
    return Target(m, tok, "tiny", "-", "0")


class TestDraft:
    """The Draft protocol's attributes for the test drafts below (no aux states, any N)."""

    aux_layer_ids: list[int] = []
    max_draft_tokens = None
    parallel = False


def greedy_continuation(target, seq: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(target.model(torch.tensor([seq + out])).logits[0, -1].argmax()))
    return out


class OracleDraft(TestDraft):
    """Proposes the target's own greedy continuation: every token must be accepted."""

    def __init__(self, target, wrong=False):
        self.target, self.wrong = target, wrong

    def begin(self, *a):
        pass

    def commit(self, *a):
        pass

    def propose(self, sequences, n, sampling):
        rows = []
        for seq in sequences:
            seq = list(seq)
            out = []
            for _ in range(n):
                logits = self.target.model(torch.tensor([seq])).logits[0, -1]
                t = int(logits.argmax())
                if self.wrong:  # never the target's choice
                    t = (t + 1) % logits.numel()
                out.append(t)
                seq.append(t)
            rows.append(out)
        return Proposal(torch.tensor(rows))


class ConstantDraft(TestDraft):
    """Always proposes one token: what the constant-proposal probe serves in vLLM."""

    def __init__(self, token):
        self.token = token

    def begin(self, *a):
        pass

    def commit(self, *a):
        pass

    def propose(self, sequences, n, sampling):
        return Proposal(torch.full((len(sequences), n), self.token))


class FixedDistributionDraft(TestDraft):
    """Samples from a fixed distribution q (not the target's) and says so."""

    def __init__(self, q, seed=1):
        self.q, self.g = q, torch.Generator().manual_seed(seed)

    def begin(self, *a):
        pass

    def commit(self, *a):
        pass

    def propose(self, sequences, n, sampling):
        B = len(sequences)
        x = torch.multinomial(self.q.expand(B * n, -1), 1, generator=self.g).view(B, n)
        return Proposal(x, self.q.expand(B, n, -1).clone())


PROMPTS = [[5, 17, 42, 8, 99], [7, 7, 7], [120, 3, 56, 200, 11, 9, 30, 4]]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_greedy_speculative_equals_greedy_target(n):
    t = tiny_target()
    ar, _ = generate(t, PROMPTS, 16)
    for draft in (NGramDraft(), OracleDraft(t), OracleDraft(t, wrong=True)):
        out, stats = generate(t, PROMPTS, 16, draft, num_draft_tokens=n)
        assert out == ar, type(draft).__name__
    # and the in-tree autoregressive decoder equals HF generate, row by row
    for p, a in zip(PROMPTS, ar):
        ref = t.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):]
        assert a == ref.tolist()


def test_oracle_draft_gives_tau_n_plus_1_and_adversarial_gives_1():
    t = tiny_target()
    _, good = generate(t, PROMPTS, 13, OracleDraft(t), num_draft_tokens=3)
    assert good.tau == 4.0 and good.cumulative_acceptance == [1.0, 1.0, 1.0]
    _, bad = generate(t, PROMPTS, 13, OracleDraft(t, wrong=True), num_draft_tokens=3)
    assert bad.tau == 1.0 and bad.cumulative_acceptance == [0.0, 0.0, 0.0]


def test_cache_rollback_after_partial_acceptance_is_exact():
    t = tiny_target()
    session = spec.TargetSession(t)
    first = int(session.prefill([PROMPTS[0]]).logits[0, -1].argmax())  # the whole prompt, as vLLM prefills
    out = session.verify(torch.tensor([[first, 11, 12, 13]]))
    session.commit(torch.tensor([[True, True, False, False]]))  # keep pending + 1 draft token
    assert session.cache.get_seq_length() == len(PROMPTS[0]) + 2
    after = session.verify(torch.tensor([[50]]))
    fresh = t.model(torch.tensor([PROMPTS[0] + [first, 11, 50]])).logits[0, -1]
    torch.testing.assert_close(after.logits[0, -1], fresh, atol=1e-5, rtol=1e-5)
    assert out.logits.shape[1] == 4


def _chi_square_threshold(dof, z=3.09):  # Wilson-Hilferty, upper 0.1%
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _joint(t, prompt, sampling, draft, n_rows, seed, length=2):
    """Counts of the first `length` generated tokens over V**length outcomes. Token 1 comes from
    the prefill (as vLLM takes it); with num_draft_tokens=2, tokens 2 and 3 are the first round's
    draft positions 1 and 2 (or the resampled token where one is rejected) and token 4 its bonus
    token (or the next round's first): length 4 checks every position of a round."""
    out, _ = generate(t, [prompt] * n_rows, length, draft, num_draft_tokens=2, sampling=sampling, seed=seed)
    V = t.vocab_size
    counts = torch.zeros(V ** length)
    for row in out:
        counts[sum(x * V ** (length - 1 - k) for k, x in enumerate(row[:length]))] += 1
    return counts


def _exact_joint(t, prompt, sampling, length=2):
    """The target's own distribution of its first `length` sampled tokens, [V**length]."""
    with torch.no_grad():
        joint, prefixes = torch.ones(1), [list(prompt)]
        for _ in range(length):
            p = spec.processed_probs(t.model(torch.tensor(prefixes)).logits[:, -1], sampling)  # [prefixes, V]
            joint = (joint[:, None] * p).flatten()
            prefixes = [seq + [x] for seq in prefixes for x in range(p.shape[-1])]
    return joint


def test_sampled_output_has_the_targets_distribution(monkeypatch):
    torch.manual_seed(0)
    t = tiny_target(vocab=6)
    sampling = Sampling(temperature=1.0, top_k=5)
    prompt = [1, 4, 2]
    q = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])  # a draft that is plainly not the target
    expected = _exact_joint(t, prompt, sampling)
    n = 6000

    def chi2(counts):
        keep = expected > 0
        if counts[~keep].sum() > 0:  # emitted a token outside top-k: impossible under the target
            return math.inf, int(keep.sum()) - 1
        e = expected[keep] * n
        return float(((counts[keep] - e) ** 2 / e).sum()), int(keep.sum()) - 1

    stat, dof = chi2(_joint(t, prompt, sampling, FixedDistributionDraft(q), n, seed=3))
    assert stat < _chi_square_threshold(dof), (stat, dof)
    # Power: a wrong acceptance rule (always accept) must fail the same test.
    real_verify = spec.verify

    def always_accept(p, q_, x, greedy, generator=None, lengths=None):
        return real_verify(p, q_, x, greedy=True, generator=generator) if greedy else \
            (torch.full((x.shape[0],), x.shape[1]), torch.multinomial(p[:, -1], 1, generator=generator)[:, 0])

    monkeypatch.setattr(spec, "verify", always_accept)
    stat_bad, _ = chi2(_joint(t, prompt, sampling, FixedDistributionDraft(q), n, seed=3))
    assert stat_bad > _chi_square_threshold(dof), stat_bad


def test_every_position_of_a_round_and_its_bonus_token_have_the_targets_distribution(monkeypatch):
    """The joint of the first four sampled tokens (the prefill's, both draft positions of the
    first round and its bonus token) is the target's, by a chi-square test over the 3**4 outcomes
    of a 3-token vocabulary; the always-accept rule fails the same test."""
    t = tiny_target(vocab=3)
    sampling = Sampling(temperature=1.0)
    prompt = [1, 2, 0]
    q = torch.tensor([0.6, 0.3, 0.1])  # plainly not the target
    expected = _exact_joint(t, prompt, sampling, 4)
    n = 8000

    def chi2(counts):
        e = expected * n
        return float(((counts - e) ** 2 / e).sum()), expected.numel() - 1

    stat, dof = chi2(_joint(t, prompt, sampling, FixedDistributionDraft(q), n, seed=5, length=4))
    assert stat < _chi_square_threshold(dof), (stat, dof)
    real_verify = spec.verify

    def always_accept(p, q_, x, greedy, generator=None, lengths=None):
        return real_verify(p, q_, x, greedy=True, generator=generator) if greedy else \
            (torch.full((x.shape[0],), x.shape[1]), torch.multinomial(p[:, -1], 1, generator=generator)[:, 0])

    monkeypatch.setattr(spec, "verify", always_accept)
    stat_bad, _ = chi2(_joint(t, prompt, sampling, FixedDistributionDraft(q), n, seed=5, length=4))
    assert stat_bad > _chi_square_threshold(dof), stat_bad


def _tiny_eagle3(t, **norms):
    cfg = Eagle3Config(draft_vocab_size=128, **norms).fill_from_target(t.model.config, [1, 2, 3])
    d = Eagle3Draft(cfg, t.backbone.embed_tokens)
    d.set_vocab(torch.arange(128) * 2 - torch.arange(128), torch.arange(t.vocab_size) % 2 == 0)  # even ids
    return d


def _training_time_q(t, d, ext: list[int], i: int, K: int) -> torch.Tensor:
    """The training-time test unrolled over `ext` (committed tokens + the proposals): the
    draft's distribution at position i for steps 0..K-1, over the draft vocabulary. [K, Vd]"""
    full = t.forward(torch.tensor([ext]), aux_layer_ids=[1, 2, 3])
    ids = torch.tensor([ext])
    hidden, cache, out = d.fuse(full.aux_hidden_states), [], []
    for k in range(K):
        tokens = torch.cat([ids[:, 1 + k:], torch.zeros(1, 1 + k, dtype=ids.dtype)], 1)  # token i+1+k
        hidden, logits = d.step(tokens, d.carry(hidden) if k else hidden, torch.arange(len(ext))[None] + k, cache)
        out.append(logits[0, i].softmax(-1))
    return torch.stack(out)


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}])
def test_eagle3_proposer_chain_and_commit_equal_the_training_time_steps(norms):
    """Every chained proposal step, in a first round and again after a partial acceptance
    (commit with rejected slots cropped), is the training-time step at the same position; with
    vLLM's three norm options (speculators' EAGLE-3 defaults) too."""
    t = tiny_target()
    d = _tiny_eagle3(t, **norms)
    for name, p in d.named_parameters():  # norm weights away from 1: where a norm sits matters
        if "norm" in name:
            torch.nn.init.normal_(p, mean=1.0, std=0.3)
    N, seq = 4, PROMPTS[2]
    prop = Eagle3Proposer(d, draft_sampling="probabilistic", seed=0)
    session = spec.TargetSession(t, [1, 2, 3])
    pre = session.prefill([seq])
    seq = seq + [int(pre.logits[0, -1].argmax())]  # the first token, from the prefill
    prop.begin([seq], pre.aux_hidden_states, session.mask)
    sampling = Sampling(temperature=1.0)
    for round_ in range(2):
        p = prop.propose([seq], N, sampling)
        x = p.tokens[0].tolist()
        want = _training_time_q(t, d, seq + x, len(seq) - 2, N)  # [N, Vd]
        torch.testing.assert_close(p.q[0][:, prop.target_ids], want, atol=1e-5, rtol=1e-4,
                                   msg=f"round {round_}")
        # the target verifies [pending, x_1..x_N]; keep pending + 2 accepted, correct the third
        out = session.verify(torch.tensor([[seq[-1], *x]]))
        keep = torch.tensor([[True, True, True, False, False]])
        session.commit(keep)
        seq = seq + x[:2] + [(x[2] + 2) % t.vocab_size]
        prop.commit([seq], out.aux_hidden_states, keep)
        assert prop.mask.shape[1] == session.mask.shape[1]  # the draft's KV was cropped like the target's
    # greedy drafting (vLLM's default) proposes the argmax of the same distributions
    greedy, seq = Eagle3Proposer(d), PROMPTS[2]
    session = spec.TargetSession(t, [1, 2, 3])
    pre = session.prefill([seq])
    seq = seq + [int(pre.logits[0, -1].argmax())]  # the first token, from the prefill
    greedy.begin([seq], pre.aux_hidden_states, session.mask)
    p = greedy.propose([seq], N, Sampling(temperature=1.0))
    want = _training_time_q(t, d, seq + p.tokens[0].tolist(), len(seq) - 2, N)
    assert p.q is None and p.tokens[0].tolist() == greedy.target_ids[want.argmax(-1)].tolist()


def test_eagle3_proposer_is_lossless_and_reproducible():
    t = tiny_target()
    d = _tiny_eagle3(t)
    ar, _ = generate(t, PROMPTS, 12)
    out, _ = generate(t, PROMPTS, 12, Eagle3Proposer(d), num_draft_tokens=3)
    assert out == ar
    s = Sampling(temperature=0.9)
    runs = [generate(t, PROMPTS, 12, Eagle3Proposer(d, draft_sampling=m, seed=5), num_draft_tokens=3, sampling=s,
                     seed=5) for m in ("probabilistic", "probabilistic", "greedy")]
    assert runs[0][0] == runs[1][0] and runs[0][1].accepted == runs[1][1].accepted  # seeded
    assert all(len(o) == 12 for o in runs[2][0])


@pytest.mark.slow
def test_greedy_speculative_equals_greedy_smollm2_fp32(smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"]
               for c in ("Write a Python function that adds two numbers.", "What is 12 times 7?")]
    ar, _ = generate(smollm2, prompts, 24, eos_token_ids=[tok.eos_token_id])
    for n in (2, 5):
        out, stats = generate(smollm2, prompts, 24, NGramDraft(), num_draft_tokens=n, eos_token_ids=[tok.eos_token_id])
        assert out == ar, n
        assert stats.rounds > 0


def constant_draft_counts(output: list[int], token: int, n: int) -> dict:
    """What a draft that always proposes `token` gets accepted on a greedy `output`
    (generated tokens only). The first token comes from the prefill; each later round
    drafts n tokens, accepts the leading run equal to the target's next tokens, and
    commits it plus one target token. Rounds happen while tokens remain to generate.
    Choose `token` absent from the last n+1 tokens (`pick_constant_token`): what vLLM would
    accept beyond max_tokens is not in `output`."""
    drafts = accepted = 0
    per_pos = [0] * n
    c = 1
    while c < len(output):
        k = 0
        while k < n and c + k < len(output) and output[c + k] == token:
            k += 1
        drafts += 1
        accepted += k
        for j in range(k):
            per_pos[j] += 1
        c += k + 1
    return {"num_drafts": drafts, "num_accepted_tokens": accepted, "accepted_per_position": per_pos}


def pick_constant_token(outputs: list[list[int]], n: int, max_token: int, exclude=()) -> int:
    """The token most frequent in the greedy outputs, not within the last n+1 tokens of any
    output, not special (`exclude`), and <= max_token (= V - Vd)."""
    banned = set(exclude) | {t for o in outputs for t in o[-(n + 1):]}
    counts = Counter(t for o in outputs for t in o[1:] if t not in banned and t <= max_token)
    if not counts:
        raise AssertionError("no usable constant token in the outputs; generate more tokens")
    return counts.most_common(1)[0][0]


def test_rounds_are_counted_as_vllm_counts_them():
    """The first token comes from the prefill, then one round per step until a row is done:
    a constant draft's counts equal `constant_draft_counts`, vLLM's counting written out
    (vllm/v1/core/sched/scheduler.py update_from_output); the real vLLM's counts equal the
    in-tree decoder's for trained drafts (tests/test_vllm.py)."""
    t = tiny_target()
    N, max_new = 3, 20
    ar, _ = generate(t, PROMPTS, max_new)
    token = pick_constant_token(ar, N, t.vocab_size - 1)
    out, stats = generate(t, PROMPTS, max_new, ConstantDraft(token), num_draft_tokens=N)
    assert out == ar
    want = [constant_draft_counts(o, token, N) for o in ar]
    assert stats.counts() == {"num_drafts": sum(w["num_drafts"] for w in want),
                              "num_accepted_tokens": sum(w["num_accepted_tokens"] for w in want),
                              "accepted_per_position": [sum(w["accepted_per_position"][j] for w in want)
                                                        for j in range(N)]}
    assert stats.accepted > 0 and stats.rounds == sum(len(o) - 1 for o in ar) - stats.accepted  # no round past the end
    # a first token that ends the row: no draft round at all (vLLM never drafts for it)
    first = [o[0] for o in ar]
    _, ended = generate(t, PROMPTS, max_new, ConstantDraft(token), num_draft_tokens=N, eos_token_ids=first)
    assert ended.rounds == 0 and ended.generated == len(PROMPTS)


def _tiny_draft(t, algorithm):
    """A random draft of each algorithm on the tiny target, aux layers 1..3."""
    from trainer.drafts.registry import build, get

    torch.manual_seed(0)
    extra = {"eagle3": {"draft_vocab_size": 128}, "dflash": {"num_hidden_layers": 2, "block_size": 5},
             "dspark": {"num_hidden_layers": 2, "block_size": 4, "markov_rank": 8}}[algorithm]
    if algorithm != "eagle3":
        extra["mask_token_id"] = t.vocab_size - 1
    cfg = get(algorithm).Config(**extra).fill_from_target(t.model.config, [1, 2, 3])
    d = build(algorithm, cfg, t)
    for name, p in d.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    if algorithm == "eagle3":
        d.set_vocab(torch.arange(128) * 2 - torch.arange(128), torch.arange(t.vocab_size) % 2 == 0)  # even ids
    return d


class HalfRight(TestDraft):
    """A real proposer whose tokens are replaced, slot by slot with probability 1/2, by the
    target's greedy continuation: partial acceptance (and so rollback of the proposer's state)
    in most rounds. At every round it also checks that the proposer's incremental state equals
    a fresh proposer's begun on the committed tokens (its first-slot distribution)."""

    def __init__(self, target, make, seed=0):
        self.t, self.make, self.inner = target, make, make()
        self.aux_layer_ids = self.inner.aux_layer_ids
        self.max_draft_tokens = self.inner.max_draft_tokens
        self.g = torch.Generator().manual_seed(seed)
        self.checked = 0

    def begin(self, sequences, aux, mask):
        self.inner.begin(sequences, aux, mask)

    def commit(self, sequences, aux, keep):
        self.inner.commit(sequences, aux, keep)

    def propose(self, sequences, n, sampling):
        probe = Sampling(temperature=1.0)
        fresh = self.make()
        session = spec.TargetSession(self.t, self.aux_layer_ids)
        pre = session.prefill([s[:-1] for s in sequences])  # every committed position, padded, in one forward
        fresh.begin([list(s) for s in sequences], pre.aux_hidden_states, session.mask)
        want = fresh.propose(sequences, 1, probe).q[:, 0]
        got = self.inner.propose(sequences, 1, probe).q[:, 0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        self.checked += 1
        x = self.inner.propose(sequences, n, sampling).tokens.clone()
        for r, seq in enumerate(sequences):
            right = greedy_continuation(self.t, list(seq), n)
            for j in range(n):
                if torch.rand(1, generator=self.g) < 0.5:
                    x[r, j] = right[j]
        return Proposal(x)


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_partial_acceptance_is_lossless_and_rolls_the_draft_back_exactly(algorithm):
    from trainer.drafts.registry import get

    t = tiny_target()
    d = _tiny_draft(t, algorithm)
    make = lambda: get(algorithm).Proposer(d, draft_sampling="probabilistic")  # noqa: E731
    ar, _ = generate(t, PROMPTS, 14)
    draft = HalfRight(t, make)
    out, stats = generate(t, PROMPTS, 14, draft, num_draft_tokens=3)
    assert out == ar
    assert 0 < stats.accepted < 3 * stats.rounds and draft.checked == stats.iterations
    partial = stats.accepted_at[0] - stats.accepted_at[-1]  # rounds that accepted some but not all
    assert partial > 0, stats.accepted_at


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_draft_sampling_applies_temperature_only_as_vllms_draft_sampler(algorithm):
    """vLLM's draft sampler (llm_base_proposer.compute_probs_and_sample_next_token) divides by the
    temperature and ignores top-k/top-p: under top_k=2, top_p=0.3 the draft's q keeps its whole
    support, equals the same draft's q without them, and is softmax(logits / T) (the target's p is
    the one that gets top-k/top-p)."""
    from trainer.drafts.registry import get

    t = tiny_target()
    d = _tiny_draft(t, algorithm)
    qs = {}
    for name, sampling in (("plain", Sampling(temperature=0.7)),
                           ("truncated", Sampling(temperature=0.7, top_k=2, top_p=0.3)),
                           ("t1", Sampling(temperature=1.0))):
        prop = get(algorithm).Proposer(d, draft_sampling="probabilistic", seed=1)
        session = spec.TargetSession(t, [1, 2, 3])
        pre = session.prefill([PROMPTS[0]])
        seq = PROMPTS[0] + [int(pre.logits[0, -1].argmax())]
        prop.begin([seq], pre.aux_hidden_states, session.mask)
        qs[name] = prop.propose([seq], 3, sampling)
    assert torch.equal(qs["plain"].q, qs["truncated"].q) and torch.equal(qs["plain"].tokens, qs["truncated"].tokens)
    first = qs["truncated"].q[0, 0]
    assert int((first > 0).sum()) > 2  # neither top-k's 2 tokens nor top-p's nucleus
    # q lives on the draft vocabulary (mapped to target ids) and sums to 1 there
    target_ids = spec.DraftSampler(d, "probabilistic").target_ids
    outside = torch.ones_like(first, dtype=torch.bool)
    outside[target_ids] = False
    assert first[outside].sum() == 0 and torch.isclose(first[target_ids].sum(), torch.tensor(1.0))
    assert spec.processed_probs(torch.log(first), Sampling(temperature=0.7, top_k=2)).gt(0).sum() == 2  # p's rule
    # and the temperature is applied: q at T = 0.7 is softmax(log q(T = 1) / 0.7) (a sampler that
    # ignored T would give q(T = 1) itself; the first position's q depends on no sampled token)
    at_one = qs["t1"].q[0, 0][target_ids]
    torch.testing.assert_close(first[target_ids], torch.softmax(torch.log(at_one) / 0.7, -1), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(first[target_ids], at_one, atol=1e-3)


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_decodes_sharing_one_prefill_equal_decodes_prefilling_alone(algorithm):
    """measure_together (one prefill per batch, kept by Prefills and handed to the later decodes:
    plain and two different drafts) counts and generates what each decode gives prefilling alone,
    sampled, in batches; measure_with_baseline (eval's plain and speculative) is its pair; and the
    kept prefill was handed out once per later decode of a batch."""
    from trainer.drafts.registry import get

    t = tiny_target()
    d, other = _tiny_draft(t, algorithm), _tiny_draft(t, algorithm)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)  # another draft on the same aux layers
    s, prompts = Sampling(temperature=0.8, top_k=20), PROMPTS + PROMPTS[:1]
    common = dict(sampling=s, eos_token_ids=(), batch_size=2, seed=3)
    make = lambda draft=d: get(algorithm).Proposer(draft, draft_sampling="probabilistic", seed=1)  # noqa: E731
    alone = [spec.measure(t, None, prompts, 10, **common), spec.measure(t, make(), prompts, 10, 3, **common),
             spec.measure(t, make(other), prompts, 10, 3, **common)]
    assert alone[1].counts() != alone[2].counts()  # two drafts that differ
    together = spec.measure_together(t, [None, make(), make(other)], prompts, 10, 3, **common)
    pair = spec.measure_with_baseline(t, make(), prompts, 10, 3, **common)
    for a, shared in [*zip(alone, together), *zip(alone, pair)]:
        assert shared.counts() == a.counts() and shared.generated == a.generated
        assert shared.rounds == a.rounds and shared.iterations == a.iterations
    kept = spec.Prefills(make().aux_layer_ids)
    outs = [generate(t, PROMPTS[:2], 10, draft, 3, s, seed=3, prefills=kept)[0] for draft in (None, make(), make())]
    assert outs[1] == outs[2] and kept.reused == 2 and len(kept.kept) == 1
    assert outs[0] == generate(t, PROMPTS[:2], 10, None, 3, s, seed=3)[0]


def test_a_prefill_computes_only_its_last_logits_and_they_are_the_full_forwards():
    t = tiny_target()
    ids = torch.tensor([PROMPTS[0]])
    full = t.forward(ids).logits
    last = t.forward(ids, logits_to_keep=1).logits
    assert last.shape[1] == 1
    torch.testing.assert_close(last[:, -1], full[:, -1], atol=1e-6, rtol=1e-6)
