"""DFlash on a tiny target: the packed anchor-block training step equals one block at a
time; the in-tree proposer's proposals (first round, and after a partial acceptance)
are the training-time logits at the same anchor; decoding is lossless; a trained draft
accepts in decoding what it learned in training (labels, RoPE positions and layer ids
line up); the export layout vLLM reads."""

import json

import pytest
import torch

import trainer.speculative as spec
from recipes import train
from tests.conftest import REPO, make_tiny_model, make_tiny_tokenizer
from trainer.config import TrainConfig, load_config
from trainer.drafts import dflash
from trainer.drafts.registry import build
from trainer.speculative import Sampling, generate
from trainer.target import Target

TINY = REPO / "recipes" / "configs" / "tiny" / "dflash.yaml"
PROMPTS = [[5, 9, 11, 40, 41, 42, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 101, 102, 50, 60, 70, 80, 90]]
IDS = [1, 2, 3]


def make_target():
    tok = make_tiny_tokenizer()
    return Target(make_tiny_model(len(tok)), tok, "tiny", "-", "0")


def tiny_draft(t, block_size=5, layers=2, seed=0, draft_vocab_size=None):
    torch.manual_seed(seed)
    cfg = dflash.Config(num_hidden_layers=layers, block_size=block_size, mask_token_id=t.vocab_size - 1,
                        draft_vocab_size=draft_vocab_size).fill_from_target(t.model.config, IDS)
    d = build("dflash", cfg, t)
    for name, p in d.named_parameters():  # norms away from 1: their placement matters
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    return d


def test_default_layer_ids():
    assert dflash.default_layer_ids(36) == [2, 10, 18, 26, 34]  # output ids 1, 9, 17, 25, 33 (Qwen3-8B)
    assert dflash.default_layer_ids(30) == [2, 9, 15, 21, 28]
    for L in range(2, 80):
        ids = dflash.default_layer_ids(L)
        assert ids and ids == sorted(set(ids)) and 1 <= ids[0] and ids[-1] <= L, (L, ids)


def test_block_inputs_mask_and_positions():
    ids = torch.arange(10)[None] + 100
    anchors, valid = torch.tensor([[2, 6]]), torch.tensor([[True, True]])
    block_ids, pos, allowed = dflash.block_inputs(ids, anchors, valid, 10, 3, mask_token_id=7)
    assert block_ids.tolist() == [[102, 7, 7, 106, 7, 7]]
    assert pos.tolist() == [[2, 3, 4, 6, 7, 8]]
    a = allowed[0, 0]  # [6 queries, 10 context + 6 block keys]
    for q in range(6):
        anchor = [2, 6][q // 3]
        assert a[q, :10].tolist() == [t < anchor for t in range(10)]  # context strictly before the anchor
        assert a[q, 10:].tolist() == [k // 3 == q // 3 for k in range(6)]  # own block, both ways


def test_anchors_are_drawn_only_where_an_answer_token_follows():
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1, 1, 1]])
    attn = torch.tensor([[1] * 8, [1, 1, 1, 1, 1, 1, 0, 0]])  # row 1 ends in two pad positions
    # by hand: p eligible when p and p+1 are answer tokens and p+1 is not padding
    want = [[p < 7 and bool(loss[b, p] and loss[b, p + 1] and attn[b, p + 1]) for p in range(8)] for b in range(2)]
    assert dflash.anchor_eligible(loss, attn).tolist() == want  # [[1,2,5], [0,3,4]]
    anchors, valid = dflash.sample_anchors(loss, attn, 8, torch.Generator().manual_seed(0))
    for b in range(2):
        assert sorted(anchors[b][valid[b]].tolist()) == [p for p in range(8) if want[b][p]]


def _context(t, d, seq):
    return t.forward(torch.tensor([seq]), aux_layer_ids=IDS).aux_hidden_states


def _block_logits(t, d, seq, anchor, n):
    """One block on its own: context = the target's states at positions < anchor."""
    aux = _context(t, d, seq[:anchor])
    kv = d.context_kv(d.context(aux), torch.arange(anchor)[None])
    block = torch.tensor([[seq[anchor]] + [d.config.mask_token_id] * n])
    pos = anchor + torch.arange(n + 1)[None]
    allowed = torch.ones(1, 1, n + 1, anchor + n + 1, dtype=torch.bool)
    return d.logits(d.blocks(block, pos, kv, allowed))[0, 1:]  # [n, V]


def test_packed_training_blocks_equal_one_block_at_a_time():
    t = make_target()
    d = tiny_draft(t).double()
    t.model.double()
    seq = PROMPTS[1] + PROMPTS[0]
    T, K = len(seq), d.config.block_size
    ids = torch.tensor([seq])
    anchors, valid = torch.tensor([[3, 7, 10]]), torch.ones(1, 3, dtype=torch.bool)
    ctx = d.context(_context(t, d, seq))
    kv = d.context_kv(ctx, torch.arange(T)[None])
    block_ids, pos, allowed = dflash.block_inputs(ids, anchors, valid, T, K, d.config.mask_token_id)
    packed = d.logits(d.blocks(block_ids, pos, kv, allowed)).view(3, K, -1)[:, 1:]
    for j, a in enumerate([3, 7, 10]):
        torch.testing.assert_close(packed[j], _block_logits(t, d, seq, a, K - 1), msg=f"anchor {a}")


@pytest.mark.parametrize("draft_vocab_size", [None, 96])
def test_proposals_equal_the_training_time_logits_at_the_anchor(draft_vocab_size):
    """First round and after a partial acceptance (commit with rejected slots cropped):
    slot k's distribution is the training-time slot k of the block anchored at the pending token."""
    t = make_target()
    d = tiny_draft(t, draft_vocab_size=draft_vocab_size)
    if draft_vocab_size:
        d.d2t.copy_(torch.arange(96) * 2 - torch.arange(96))  # even ids
    N, seq = 4, PROMPTS[2]
    prop = dflash.Proposer(d, draft_sampling="probabilistic", seed=0)
    session = spec.TargetSession(t, IDS)
    pre = session.prefill([seq])
    seq = seq + [int(pre.logits[0, -1].argmax())]  # the first token, from the prefill
    prop.begin([seq], pre.aux_hidden_states, session.mask)
    for round_ in range(2):
        p = prop.propose([seq], N, Sampling(temperature=1.0))
        want = _block_logits(t, d, seq + [0] * N, len(seq) - 1, N).softmax(-1)  # anchor = the pending token
        torch.testing.assert_close(p.q[0][:, prop.target_ids], want, atol=1e-5, rtol=1e-4, msg=f"round {round_}")
        x = p.tokens[0].tolist()
        out = session.verify(torch.tensor([[seq[-1], *x]]))
        keep = torch.tensor([[True, True, True, False, False]])
        session.commit(keep)
        seq = seq + x[:2] + [(x[2] + 2) % t.vocab_size]
        prop.commit([seq], out.aux_hidden_states, keep)
        assert prop.mask.shape[1] == session.mask.shape[1] == len(seq) - 1


def test_greedy_decoding_with_a_dflash_draft_is_lossless():
    t = make_target()
    d = tiny_draft(t)
    ar, _ = generate(t, PROMPTS, 12)
    for n in (1, 4):
        out, stats = generate(t, PROMPTS, 12, dflash.Proposer(d), num_draft_tokens=n)
        assert out == ar and stats.rounds > 0
    with pytest.raises(Exception, match=r"proposes \(4\); use at most 4"):
        generate(t, PROMPTS, 4, dflash.Proposer(d), num_draft_tokens=5)


def test_mask_token_is_never_a_used_or_special_token():
    counts = torch.tensor([0, 5, 0, 3, 0, 1])
    assert dflash.choose_mask_token(counts, special_ids=[4]) == 2
    with pytest.raises(Exception, match="no unused id"):
        dflash.choose_mask_token(torch.tensor([0, 1, 1]), special_ids=[0])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dir, tiny_target):
    """A tiny DFlash draft trained on the tiny target's own greedy continuations (spliced in as
    ids, see test_export.py), with layers 1..3 captured."""

    from recipes import capture, prepare
    from tests.conftest import GOOD_CHATS, splice_prepared, write_jsonl
    from trainer.config import CaptureConfig, PrepareConfig

    d = tmp_path_factory.mktemp("dflash")
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target=str(tiny_target_dir),
                              source=str(write_jsonl(d / "c.jsonl", GOOD_CHATS)), max_length=256))
    answers, _ = generate(tiny_target, PROMPTS, 48, None)
    rows = {"input_ids": [p + a for p, a in zip(PROMPTS, answers)],
            "loss_mask": [[0] * (len(p) - 1) + [1] * (len(a) + 1) for p, a in zip(PROMPTS, answers)]}
    splice_prepared(d / "prepared", rows)
    capture.run(CaptureConfig(data=str(d / "prepared"), output_dir=str(d / "capture"), target=str(tiny_target_dir),
                              drafts=["eagle3", "dflash"], aux_layer_ids=IDS, store_dtype="float32",
                              draft_vocab_size=320))
    r = train.run(load_config(TrainConfig, TINY, [f"data={d / 'capture'}", f"target={tiny_target_dir}",
                                                  f"output_dir={d / 'dflash'}", "max_steps=80", "epochs=200",
                                                  "batch_size=1", "log_every=10", "draft.num_hidden_layers=2",
                                                  "learning_rate=0.005", "save_every=1000"]))
    return d / "dflash", r


def test_a_trained_draft_accepts_in_decoding_what_it_learned(trained, tiny_target):
    """Labels shifted by a slot, block positions off by one or the wrong layers all give high
    training accuracy and τ ≈ 1 in decoding; here decoding must keep what training measured."""
    from trainer.drafts.folder import load_draft

    out, report = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algorithm"] == "dflash" and cfg["draft"]["aux_layer_ids"] == IDS
    assert cfg["draft"]["mask_token_id"] not in tiny_target.tokenizer.all_special_ids
    simulated = report["final"]["tau"]
    algorithm, draft = load_draft(out, tiny_target)
    _, stats = generate(tiny_target, PROMPTS, 48, dflash.Proposer(draft), num_draft_tokens=3)
    assert simulated > 2.5, report["final"]
    assert stats.tau > 0.8 * simulated, (stats.tau, simulated)


def test_bf16_export_is_vllms_dflash_layout_and_reloads(trained, tmp_path, tiny_target_dir, tiny_target):
    from safetensors.torch import load_file

    from export import formats
    from recipes import export_draft as export_recipe

    out, _ = trained
    export_recipe.main(["--draft", str(out), "--target", str(tiny_target_dir), "--output-dir", str(tmp_path / "e"),
                        "--num-draft-tokens", "3"])
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    mask_token_id = json.loads((out / "config.json").read_text())["draft"]["mask_token_id"]
    assert cfg["dflash_config"] == {"mask_token_id": mask_token_id,
                                    "target_layer_ids": [0, 1, 2]}  # output-of-layer: vLLM reads i + 1 = IDS
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # vLLM would read it instead, without the +1
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 3 and cfg["num_hidden_layers"] == 2
    assert cfg["max_position_embeddings"] >= tiny_target.model.config.max_position_embeddings
    assert cfg["rope_parameters"]["rope_theta"] == tiny_target.model.config.rope_parameters["rope_theta"]
    written = load_file(tmp_path / "e" / "model.safetensors")
    assert "lm_head.weight" not in written and "embed_tokens.weight" not in written  # the target's
    assert written["layers.1.self_attn.k_norm.weight"].dtype == torch.bfloat16
    layer = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj")
    vllm_names = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {  # qwen3_dflash.py's, before its model. prefix
        f"layers.{i}.{n}.weight" for i in range(2) for n in layer}
    assert set(written) == vllm_names
    back = formats.draft_state_from_export(tmp_path / "e")
    src = load_file(out / "model.safetensors")
    assert all(torch.equal(back[k], src[k].to(torch.bfloat16)) for k in src)
    m = json.loads((tmp_path / "e" / "draftsmith_export.json").read_text())
    assert m["method"] == "dflash" and '"method": "dflash"' in formats.serve_command("t", "e", 3, m["method"])
    with pytest.raises(SystemExit):  # a block of 4 proposes 3 tokens at most
        export_recipe.main(["--draft", str(out), "--target", str(tiny_target_dir), "--output-dir",
                            str(tmp_path / "e2"), "--num-draft-tokens", "4"])
    assert not (tmp_path / "e2").exists()


def test_missing_weights_are_found_by_name():
    """vLLM's DFlash loader leaves an unfilled parameter at its init without a word: the
    check maps export names to vLLM's module paths (fused q/k/v and gate/up) and names it."""
    from trainer.vllm import checks

    export = ["fc.weight", "norm.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
              "layers.0.self_attn.v_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "t2d"]
    loaded = [{"name": n} for n in ("model.fc.weight", "model.norm.weight", "model.hidden_norm.weight",
                                    "model.layers.0.self_attn.qkv_proj.weight",
                                    "model.layers.0.mlp.gate_up_proj.weight",
                                    "model.embed_tokens.weight", "lm_head.weight",
                                    "model.layers.0.self_attn.qkv_proj.weight_scale")]
    assert checks.missing_in_vllm(export, loaded) == ["model.hidden_norm.weight"]


def _batch(t, seqs, mask_from=2):
    """A right-padded batch with its captured states, assistant tokens from `mask_from` on."""
    from trainer.capture import capture_batch

    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)], attn[r, :len(s)] = torch.tensor(s), 1
    loss_mask = attn.clone()
    loss_mask[:, :mask_from] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, **capture_batch(t, ids, attn, IDS)}


@pytest.mark.parametrize("labels_from", ["target", "data"])
def test_training_loss_is_the_dflash_recipe_written_out(labels_from):
    """Per sample, per valid anchor a, one block at a time: slot k (1..K-1) predicts the token
    at a+k (the target's greedy token there, or the data's), CE weighted exp(-(k-1)/gamma),
    stopping at the first slot outside the assistant span; each sample's weighted mean, then
    the mean over samples."""
    t = make_target()
    t.model.double()
    d = tiny_draft(t).double()
    d.config.labels = labels_from
    seqs = [PROMPTS[1] + PROMPTS[0], PROMPTS[2]]
    batch = _batch(t, seqs)
    torch.manual_seed(3)
    labels = dflash.target_labels(t, batch, d)
    got = dflash.training_step(d, batch, labels)
    per_sample = []
    for b, seq in enumerate(seqs):
        T = len(seq)
        greedy = t.forward(torch.tensor([seq])).logits[0].argmax(-1)  # [T] the target's token after each position
        num, den = 0.0, 0.0
        for a, ok in zip(labels["anchors"][b].tolist(), labels["valid"][b].tolist()):
            if not ok:
                continue
            logits = _block_logits(t, d, seq, a, d.config.block_size - 1)  # [K-1, V]: slots 1..K-1
            for k in range(1, d.config.block_size):
                if a + k >= T or not batch["loss_mask"][b, a + k]:
                    break
                want = int(greedy[a + k - 1]) if labels_from == "target" else seq[a + k]
                w = float(torch.exp(torch.tensor(-(k - 1) / d.config.gamma)))
                num = num + w * torch.nn.functional.cross_entropy(logits[k - 1], torch.tensor(want))
                den += w
        per_sample.append(num / max(den, 1e-6))
    torch.testing.assert_close(got.loss.double(), sum(per_sample) / len(per_sample), rtol=1e-6, atol=1e-7)


def test_chunked_loss_rows_equal_one_pass():
    """loss_chunk_rows bounds the [rows, V] logits alive at once (recomputed in backward): the
    same loss and gradients as one pass."""
    t = make_target()
    batch = _batch(t, [PROMPTS[1] + PROMPTS[0], PROMPTS[2] + PROMPTS[1]])
    results = []
    for chunk in (0, 5):
        d = tiny_draft(t).train()
        d.config.loss_chunk_rows = chunk
        torch.manual_seed(1)
        m = dflash.training_step(d, batch, dflash.target_labels(t, batch, d))
        m.loss.backward()
        results.append((m, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (m0, g0), (m1, g1) = results
    torch.testing.assert_close(m0.loss, m1.loss)
    assert torch.equal(m0.correct, m1.correct) and g0.keys() == g1.keys() and "fc.weight" in g0
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], msg=name)


@pytest.mark.slow
def test_fp8_export_is_measured_in_tree_as_vllm_computes_it(trained, tmp_path, tiny_target_dir, tiny_target):
    """A DFlash FP8 export (Quark ptpc_fp8) reloads in-tree with every quantized Linear
    simulated as vLLM computes it (FP8 weights, per-token FP8 inputs): fc stays BF16, decoding
    with it is lossless, and the gate's τ is the in-tree decoder's on it."""
    from export import formats
    from export.fp8_reload import FP8DynamicLinear
    from export.load import load_proposer
    from recipes import export_draft as export_recipe
    from trainer.speculative import measure

    out, _ = trained
    export_recipe.main(["--draft", str(out), "--target", str(tiny_target_dir), "--output-dir", str(tmp_path / "e"),
                        "--quantize", "fp8", "--no-gate"])
    _, draft = formats.load_export(tmp_path / "e", tiny_target)
    wrapped = sorted(n for n, m in draft.named_modules() if isinstance(m, FP8DynamicLinear))
    assert wrapped == sorted(f"layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))
    assert not isinstance(draft.fc, FP8DynamicLinear)
    ar, _ = generate(tiny_target, PROMPTS, 16)
    proposer, name = load_proposer(str(tmp_path / "e"), tiny_target)
    out_fp8, stats = generate(tiny_target, PROMPTS, 16, proposer, num_draft_tokens=3)
    assert out_fp8 == ar and "FP8 ptpc_fp8" in name
    again = measure(tiny_target, proposer, PROMPTS, 16, 3)
    assert again.counts() == stats.counts() and stats.tau > 1.0  # a trained draft that FP8 keeps accepting
