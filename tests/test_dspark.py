"""DSpark on a tiny target: the training step's loss is DeepSpec's, written out slot by slot;
chunked loss rows equal unchunked ones (loss and gradients); the target's distribution is
computed once per distinct position; the in-tree proposer's distributions (with the
sequential Markov correction, after a partial acceptance too) are the training-time logits
teacher-forced on the drafted tokens; top-k and the no-Markov ablation; decoding is lossless;
a trained draft accepts in decoding what it learned; the export layout vLLM reads."""

import json

import pytest
import torch
import torch.nn.functional as F

import trainer.speculative as spec
from recipes import train
from tests.conftest import REPO, make_tiny_model, make_tiny_tokenizer
from trainer.capture import capture_batch
from trainer.config import TrainConfig, load_config
from trainer.drafts import dflash, dspark
from trainer.drafts.registry import build
from trainer.speculative import Sampling, generate
from trainer.target import Target

TINY = REPO / "recipes" / "configs" / "tiny" / "dspark.yaml"
PROMPTS = [[5, 9, 11, 40, 41, 42, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 101, 102, 50, 60, 70, 80, 90]]
IDS = [1, 2, 3]


def make_target():
    tok = make_tiny_tokenizer()
    return Target(make_tiny_model(len(tok)), tok, "tiny", "-", "0")


def tiny_draft(t, block_size=4, seed=0, draft_vocab_size=None, rank=8, **kw):
    torch.manual_seed(seed)
    cfg = dspark.Config(num_hidden_layers=2, block_size=block_size, mask_token_id=t.vocab_size - 1,
                        draft_vocab_size=draft_vocab_size, markov_rank=rank, **kw).fill_from_target(t.model.config, IDS)
    d = build("dspark", cfg, t)
    for name, p in d.named_parameters():  # norms away from 1, a Markov head that matters
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    if draft_vocab_size:
        d.backbone.d2t.copy_(torch.arange(draft_vocab_size) * 2 - torch.arange(draft_vocab_size))  # even ids
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[::2] = True
        d.backbone.t2d.copy_(t2d[:cfg.vocab_size])
    return d


def batch_of(t, seqs, mask_from=2):
    """A right-padded batch with its captured states, assistant tokens from `mask_from` on."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)], attn[r, :len(s)] = torch.tensor(s), 1
    loss_mask = attn.clone()
    loss_mask[:, :mask_from] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            **capture_batch(t, ids, attn, IDS)}  # states and greedy tokens, as capture stores them


def naive_loss(t, d, batch, labels):
    """DeepSpec's loss written out: per sample, per valid anchor, per slot k until the first
    slot outside the assistant span: w_k (0.1 CE + 0.9 |q - p|_1 + BCE(c, 1 - |q - p|_1 / 2)),
    normalized by Σ w_k; then the mean over samples."""
    cfg = d.config
    ids, lm = batch["input_ids"], batch["loss_mask"]
    per_sample = []
    for b in range(ids.shape[0]):
        T = int(batch["attention_mask"][b].sum())
        seq = ids[b, :T].tolist()
        num, den = 0.0, 0.0
        for a, ok in zip(labels["anchors"][b].tolist(), labels["valid"][b].tolist()):
            if not ok:
                continue
            aux = t.forward(torch.tensor([seq[:a]]), aux_layer_ids=IDS).aux_hidden_states if a else \
                torch.zeros(1, 0, len(IDS) * cfg.target_hidden_size)
            kv = d.backbone.context_kv(d.backbone.context(aux), torch.arange(a)[None])
            block = torch.tensor([[seq[a]] + [cfg.mask_token_id] * (cfg.block_size - 1)])
            pos = a + torch.arange(cfg.block_size)[None]
            allowed = torch.ones(1, 1, cfg.block_size, a + cfg.block_size, dtype=torch.bool)
            hn = d.backbone.norm(d.backbone.blocks(block, pos, kv, allowed))[0]  # [K, H]
            full = t.forward(torch.tensor([seq])).logits[0].softmax(-1)  # [T, V]
            for k in range(cfg.block_size):
                if a + k + 1 >= T or not lm[b, a + k + 1]:
                    break
                prev = torch.tensor(seq[a + k])
                logits = d.slot_logits(hn[k], prev).float()
                q = logits.softmax(-1)
                p = full[a + k]
                dt = d.draft_to_target()
                l1 = (q - p[dt]).abs().sum() + (1 - p[dt].sum())
                want = int((dt == seq[a + k + 1]).nonzero()[0]) if (dt == seq[a + k + 1]).any() else None
                ce = F.cross_entropy(logits, torch.tensor(want)) if want is not None else 0.0
                c = d.confidence_head(hn[k], d.markov_head.markov_w1(prev))
                bce = F.binary_cross_entropy_with_logits(c, (1 - 0.5 * l1).detach().clamp(0, 1))
                w = torch.exp(torch.tensor(-k / cfg.gamma))
                num = num + w * (cfg.ce_weight * ce + cfg.tv_weight * l1 + cfg.confidence_weight * bce)
                den += float(w)
        per_sample.append(num / max(den, 1e-6))
    return sum(per_sample) / len(per_sample)


@pytest.mark.parametrize("draft_vocab_size", [None, 96])
def test_training_loss_is_deepspec_written_out(draft_vocab_size):
    t = make_target()
    t.model.double()
    d = tiny_draft(t, draft_vocab_size=draft_vocab_size).double()
    batch = batch_of(t, [PROMPTS[1] + PROMPTS[0], PROMPTS[2]])
    torch.manual_seed(3)
    labels = dspark.target_labels(t, batch, d)
    got = dspark.training_step(d, batch, labels)
    torch.testing.assert_close(got.loss, torch.as_tensor(naive_loss(t, d, batch, labels), dtype=got.loss.dtype))
    assert int(got.count[0]) == int(labels["valid"].sum())  # slot 0 of every valid block is supervised


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_loss_on_all_draws_anchors_and_slots_from_every_real_position(algorithm):
    """A block draft's `loss_on: all`: its anchors, labels, step and gradients equal `loss_on:
    assistant`'s given a loss mask that covers the whole sample (the same draws); on the sample as
    written it supervises more slots than the assistant-only step, prompt positions among them.
    DFlash with tv (it reads the target's distribution at each slot, as DSpark's DeepSpec does)."""
    def block_draft(loss_on):
        if algorithm == "dspark":
            return tiny_draft(t, loss_on=loss_on).double()
        torch.manual_seed(0)
        return build("dflash", dflash.Config(num_hidden_layers=2, block_size=4, mask_token_id=t.vocab_size - 1,
                                             loss="tv", loss_on=loss_on).fill_from_target(t.model.config, IDS),
                     t).double()

    module = {"dflash": dflash, "dspark": dspark}[algorithm]
    t = make_target()
    t.model.double()
    batch = batch_of(t, [PROMPTS[1] + PROMPTS[0], PROMPTS[2]], mask_from=6)
    every = {**batch, "loss_mask": batch["attention_mask"].clone()}
    runs = []
    for loss_on, b in (("all", batch), ("assistant", every), ("assistant", batch)):
        d = block_draft(loss_on)
        torch.manual_seed(3)
        labels = module.target_labels(t, b, d)
        m = module.training_step(d, b, labels)
        m.loss.backward()
        runs.append((labels, m, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}))
    (l_all, m_all, g_all), (l_ref, m_ref, g_ref), (l_asst, m_asst, _) = runs
    assert torch.equal(l_all["anchors"], l_ref["anchors"]) and torch.equal(l_all["valid"], l_ref["valid"])
    assert torch.equal(m_all.count, m_ref.count)
    torch.testing.assert_close(m_all.loss, m_ref.loss)
    assert g_all.keys() == g_ref.keys() and g_all
    for n in g_ref:
        torch.testing.assert_close(g_all[n], g_ref[n], msg=n)
    assert (l_all["anchors"][l_all["valid"]] < 5).any()  # anchors in the prompt (positions < 6)
    assert not (l_asst["anchors"][l_asst["valid"]] < 6).any()  # anchors only where the answer is
    assert m_all.count.sum() > m_asst.count.sum()


def test_chunked_loss_rows_equal_one_pass():
    t = make_target()
    batch = batch_of(t, [PROMPTS[1] + PROMPTS[0], PROMPTS[2] + PROMPTS[1]])
    grads = []
    for chunk in (0, 5):
        d = tiny_draft(t, loss_chunk_rows=chunk).train()
        torch.manual_seed(1)
        m = dspark.training_step(d, batch, dspark.target_labels(t, batch, d))
        m.loss.backward()
        grads.append((m.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    assert grads[0][1].keys() == grads[1][1].keys() and "markov_head.markov_w1.weight" in grads[0][1]
    for name in grads[0][1]:
        torch.testing.assert_close(grads[0][1][name], grads[1][1][name], msg=name)


def test_target_distribution_is_computed_once_per_needed_position():
    t = make_target()
    d = tiny_draft(t, draft_vocab_size=96)
    batch = batch_of(t, [PROMPTS[1] + PROMPTS[0], PROMPTS[2]])
    torch.manual_seed(0)
    labels = dspark.target_labels(t, batch, d)
    rows = labels["target_row"]
    need = rows >= 0
    assert labels["target_p"].shape[0] == int(rows.max()) + 1 <= batch["input_ids"].numel()
    full = t.forward(batch["input_ids"], batch["attention_mask"]).logits.softmax(-1)  # [B, T, V]
    pos = labels["anchors"][..., None] + torch.arange(d.config.block_size)
    for b, j, k in need.nonzero().tolist():
        p = full[b, pos[b, j, k]]
        torch.testing.assert_close(labels["target_p"][rows[b, j, k]], p[d.draft_to_target()])
        torch.testing.assert_close(labels["target_outside"][rows[b, j, k]], 1 - p[d.draft_to_target()].sum())
        assert labels["target_ids"][b, pos[b, j, k]] == p.argmax()


def _training_time_q(t, d, seq, anchor, tokens):
    """The training-time distributions of the block at `anchor` over `seq + tokens`, the
    Markov head teacher-forced on the anchor and `tokens` (as in training_step)."""
    data = seq + tokens
    aux = t.forward(torch.tensor([data[:anchor]]), aux_layer_ids=IDS).aux_hidden_states
    n = len(tokens)
    kv = d.backbone.context_kv(d.backbone.context(aux), torch.arange(anchor)[None])
    block = torch.tensor([[data[anchor]] + [d.config.mask_token_id] * (n - 1)])
    allowed = torch.ones(1, 1, n, anchor + n, dtype=torch.bool)
    hn = d.backbone.norm(d.backbone.blocks(block, anchor + torch.arange(n)[None], kv, allowed))[0]
    prev = torch.tensor(data[anchor:anchor + n])
    return d.slot_logits(hn, prev).softmax(-1)  # [n, Vd]


@pytest.mark.parametrize("draft_vocab_size", [None, 96])
def test_proposals_are_the_training_time_distributions_teacher_forced_on_the_drafts(draft_vocab_size):
    t = make_target()
    d = tiny_draft(t, draft_vocab_size=draft_vocab_size)
    N, seq = 4, PROMPTS[2]
    prop = dspark.Proposer(d, draft_sampling="probabilistic", seed=0)
    session = spec.TargetSession(t, IDS)
    pre = session.prefill([seq])
    seq = seq + [int(pre.logits[0, -1].argmax())]  # the first token, from the prefill
    prop.begin([seq], pre.aux_hidden_states, session.mask)
    for round_ in range(2):
        p = prop.propose([seq], N, Sampling(temperature=1.0))
        x = p.tokens[0].tolist()
        want = _training_time_q(t, d, seq, len(seq) - 1, x)  # anchor = the pending token
        torch.testing.assert_close(p.q[0][:, prop.target_ids], want, atol=1e-5, rtol=1e-4, msg=f"round {round_}")
        out = session.verify(torch.tensor([[seq[-1], *x]]))
        keep = torch.tensor([[True, True, True, False, False]])
        session.commit(keep)
        seq = seq + x[:2] + [(x[2] + 2) % t.vocab_size]
        prop.commit([seq], out.aux_hidden_states, keep)


def test_topk_and_the_markov_ablation():
    """Each proposer variant against the sequential Markov correction written out with the raw
    weights: base_k = lm_head(norm(h_k)) (the target's head here), bias(x) = W2 W1[x], slot k
    corrected by the token drafted before it (the anchor first)."""
    t = make_target()
    d = tiny_draft(t)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=3.0)  # a bias as large as the base logits
    N = 4
    pre_session = spec.TargetSession(t, IDS)
    pre = pre_session.prefill([PROMPTS[0]])
    seq = PROMPTS[0] + [int(pre.logits[0, -1].argmax())]  # the first token, from the prefill
    outs = {}
    for name, kw in (("markov", {}), ("topk_all", {"draft_topk": t.vocab_size}), ("top3", {"draft_topk": 3}),
                     ("base", {"markov": False})):
        prop = dspark.Proposer(d, **kw)
        session = spec.TargetSession(t, IDS)
        prop.begin([seq], session.prefill([PROMPTS[0]]).aux_hidden_states, session.mask)
        outs[name] = prop.propose([seq], N, Sampling()).tokens[0].tolist()
    anchor = len(seq) - 1
    aux = t.forward(torch.tensor([seq[:anchor]]), aux_layer_ids=IDS).aux_hidden_states
    with torch.no_grad():
        kv = d.backbone.context_kv(d.backbone.context(aux), torch.arange(anchor)[None])
        block = torch.tensor([[seq[anchor]] + [d.config.mask_token_id] * (N - 1)])
        allowed = torch.ones(1, 1, N, anchor + N, dtype=torch.bool)
        h = d.backbone.blocks(block, anchor + torch.arange(N)[None], kv, allowed)
        base = d.backbone.norm(h)[0] @ t.model.lm_head.weight.T  # [N, V]
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight  # [V, r], [V, r]

        def by_hand(topk=None, markov=True):
            prev, out = seq[anchor], []
            for k in range(N):
                logits = base[k] + (w1[prev] @ w2.T if markov else 0)
                if topk is not None:  # only the top-k base candidates get a value
                    keep = base[k].topk(topk).indices
                    logits = torch.full_like(logits, float("-inf")).scatter(0, keep, logits[keep])
                prev = int(logits.argmax())
                out.append(prev)
            return out

    assert outs["markov"] == by_hand()
    assert outs["topk_all"] == by_hand(topk=t.vocab_size) == outs["markov"]
    assert outs["top3"] == by_hand(topk=3)
    assert outs["base"] == by_hand(markov=False)
    assert outs["base"] != outs["markov"] and outs["top3"] != outs["base"]  # each variant changes the drafts


def test_greedy_decoding_with_a_dspark_draft_is_lossless():
    t = make_target()
    d = tiny_draft(t)
    ar, _ = generate(t, PROMPTS, 12)
    for n in (1, 4):
        out, stats = generate(t, PROMPTS, 12, dspark.Proposer(d), num_draft_tokens=n)
        assert out == ar and stats.rounds > 0
    with pytest.raises(Exception, match=r"proposes \(4\); use at most 4"):
        generate(t, PROMPTS, 4, dspark.Proposer(d), num_draft_tokens=5)


def test_config_refuses_other_markov_heads_and_no_markov_rank():
    with pytest.raises(Exception, match="only the vanilla head"):
        load_config(TrainConfig, TINY, ["draft.markov_head_type=mlp"])
    with pytest.raises(Exception, match="use algorithm=dflash"):
        load_config(TrainConfig, TINY, ["draft.markov_rank=0"])
    assert dspark.default_layer_ids(30) == dflash.default_layer_ids(30)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dir, tiny_target):
    """A tiny DSpark draft trained on the tiny target's own greedy continuations (spliced in
    as ids, as in test_dflash.py)."""


    from recipes import capture, prepare
    from tests.conftest import GOOD_CHATS, splice_prepared, write_jsonl
    from trainer.config import CaptureConfig, PrepareConfig

    d = tmp_path_factory.mktemp("dspark")
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target=str(tiny_target_dir),
                              source=str(write_jsonl(d / "c.jsonl", GOOD_CHATS)), max_length=256))
    answers, _ = generate(tiny_target, PROMPTS, 48, None)
    rows = {"input_ids": [p + a for p, a in zip(PROMPTS, answers)],
            "loss_mask": [[0] * (len(p) - 1) + [1] * (len(a) + 1) for p, a in zip(PROMPTS, answers)]}
    splice_prepared(d / "prepared", rows)
    capture.run(CaptureConfig(data=str(d / "prepared"), output_dir=str(d / "capture"), target=str(tiny_target_dir),
                              drafts=["dspark"], aux_layer_ids=IDS, store_dtype="float32", draft_vocab_size=320))
    r = train.run(load_config(TrainConfig, TINY, [f"data={d / 'capture'}", f"target={tiny_target_dir}",
                                                  f"output_dir={d / 'dspark'}", "max_steps=200", "epochs=400",
                                                  "batch_size=1", "log_every=10", "draft.num_hidden_layers=2",
                                                  "learning_rate=0.005", "save_every=1000"]))
    return d / "dspark", r


def test_a_trained_draft_accepts_in_decoding_what_it_learned(trained, tiny_target):
    from trainer.drafts.folder import load_draft

    out, report = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algorithm"] == "dspark" and cfg["draft"]["aux_layer_ids"] == IDS
    assert len(report["final"]["acc"]) == 4  # every slot of a block of 4 predicts
    simulated = report["final"]["tau"]
    _, draft = load_draft(out, tiny_target)
    _, stats = generate(tiny_target, PROMPTS, 48, dspark.Proposer(draft), num_draft_tokens=4)
    assert simulated > 2.5, report["final"]
    assert stats.tau > 0.8 * simulated, (stats.tau, simulated)


def test_bf16_export_is_vllms_dspark_layout_and_reloads(trained, tmp_path, tiny_target_dir, tiny_target):
    from safetensors.torch import load_file

    from export import formats
    from recipes import export_draft as export_recipe

    out, _ = trained
    export_recipe.main(["--draft", str(out), "--target", str(tiny_target_dir), "--output-dir", str(tmp_path / "e"),
                        "--num-draft-tokens", "4"])
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    trained_cfg = json.loads((out / "config.json").read_text())["draft"]
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["target_layer_ids"] == [0, 1, 2]  # output-of-layer: vLLM reads i + 1 = IDS
    assert cfg["mask_token_id"] == trained_cfg["mask_token_id"]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "dflash_config" not in cfg  # read before ours
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["sample_from_anchor"]) == (16, "vanilla", True)
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    assert cfg["block_size"] == 4 and cfg["draft_vocab_size"] == cfg["vocab_size"]
    written = load_file(tmp_path / "e" / "model.safetensors")
    V, H = tiny_target.vocab_size, tiny_target.hidden_size
    assert written["markov_head.markov_w1.weight"].shape == (V, 16)
    assert written["markov_head.markov_w2.weight"].shape == (V, 16)
    assert written["confidence_head.proj.weight"].shape == (1, H + 16)
    assert "lm_head.weight" not in written and "embed_tokens.weight" not in written  # the target's
    assert not any(k.startswith("backbone.") for k in written)
    back = formats.draft_state_from_export(tmp_path / "e")
    src = load_file(out / "model.safetensors")
    assert back.keys() == src.keys() and all(torch.equal(back[k], src[k].to(torch.bfloat16)) for k in src)
    m = json.loads((tmp_path / "e" / "draftsmith_export.json").read_text())
    assert m["method"] == "dspark"
    with pytest.raises(SystemExit):  # a block of 4 proposes 4 tokens at most
        export_recipe.main(["--draft", str(out), "--target", str(tiny_target_dir), "--output-dir",
                            str(tmp_path / "e2"), "--num-draft-tokens", "5"])
    assert not (tmp_path / "e2").exists()


def test_an_export_is_measured_with_the_options_vllm_reads_from_it(trained, tmp_path, tiny_target_dir, tiny_target):
    """`--draft-option draft_topk=K` is written where vLLM reads it (config.json
    dspark_draft_topk); the in-tree decoder measuring that export proposes with the same K
    (as vLLM serves it), unless eval names the option itself."""
    from export.load import load_proposer
    from recipes import export_draft as export_recipe
    from trainer.drafts.folder import load_draft

    out, _ = trained
    e = tmp_path / "e"
    export_recipe.main(["--draft", str(out), "--target", str(tiny_target_dir), "--output-dir", str(e),
                        "--num-draft-tokens", "4", "--draft-option", "draft_topk=2", "--dtype", "float32"])
    assert json.loads((e / "config.json").read_text())["dspark_draft_topk"] == 2
    # sampled, with drafts sampled from q: top-k changes q itself, so the counts tell the variants apart
    sampled = dict(draft_sampling="probabilistic", seed=3)
    served, name = load_proposer(str(e), tiny_target, **sampled)
    assert served.options == {"draft_topk": 2} and "draft_topk=2" in name
    _, draft = load_draft(out, tiny_target)
    runs = {}
    for label, proposer in (("export", served), ("topk2", dspark.Proposer(draft, draft_topk=2, **sampled)),
                            ("full", dspark.Proposer(draft, **sampled)),
                            ("override", load_proposer(str(e), tiny_target, draft_topk=tiny_target.vocab_size,
                                                       **sampled)[0])):
        runs[label] = generate(tiny_target, PROMPTS, 24, proposer, num_draft_tokens=4,
                               sampling=Sampling(temperature=1.0), seed=5)[1].counts()
    assert runs["export"] == runs["topk2"]  # float32 export: the same weights, the same K
    assert runs["override"] == runs["full"] != runs["topk2"]  # K changes what is drafted
