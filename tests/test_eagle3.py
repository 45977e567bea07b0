import math

import pytest
import torch

from trainer.drafts.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    default_layer_ids,
    training_step,
)
from trainer.drafts.layers import rotate_half
from trainer.errors import ConfigError
from trainer.metrics import simulated_tau


def tiny_draft(seed=0, norm_before_residual=False, **norms):
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       rms_norm_eps=1e-6, max_position_embeddings=128,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, target_hidden_size=32,
                       vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 3],
                       norm_before_residual=norm_before_residual, ttt_steps=3, **norms)
    embed = torch.nn.Embedding(50, 32)
    d = Eagle3Draft(cfg, embed)
    for p in d.parameters():  # RMSNorm weights away from 1 so that norm placement matters
        torch.nn.init.normal_(p, std=0.3)
    return d


def naive_unroll(d: Eagle3Draft, ids, fused, K):
    """Each step recomputed from scratch, position by position, with explicit key sets:
    the query at (i, step k) sees step-0 keys at positions <= i and (i, step j) for 1 <= j <= k."""
    B, T = ids.shape
    layer, att = d.midlayer, d.midlayer.self_attn
    rep = att.nh // att.nkv

    def shift(x, n):
        return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)

    def qkv(step_hidden, k):
        toks = shift(ids, 1 + k)
        e = layer.input_layernorm(d.embed_tokens(toks))
        if layer.norm_before_residual:
            h = layer.hidden_norm(step_hidden)
            res = h
        else:
            res, h = step_hidden, layer.hidden_norm(step_hidden)
        x = torch.cat([e, h], -1)
        pos = torch.arange(T)[None].expand(B, T) + k
        cos, sin = d.rotary(pos, x.dtype)
        def proj(lin, n):
            y = lin(x).view(B, T, n, att.hd).transpose(1, 2)
            return y
        q, kk, v = proj(att.q_proj, att.nh), proj(att.k_proj, att.nkv), proj(att.v_proj, att.nkv)
        c, s = cos[:, None], sin[:, None]
        q, kk = q * c + rotate_half(q) * s, kk * c + rotate_half(kk) * s
        return q, kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), res

    outs = []
    for k in range(K):
        # every step recomputed from scratch: step j reads the state step j-1 hands on (its output,
        # or with norm_output that output through the final norm) and the keys of steps 0..j
        state_in, kvs = fused, []
        for j in range(k + 1):
            q, kk, v, res = qkv(state_in, j)
            kvs.append((kk, v))
            state = _naive_layer(d, q, kvs, res, T)
            state_in = d.norm(state) if d.config.norm_output else state
        outs.append(d.lm_head(d.norm(state)))
    return outs


def _naive_layer(d, q, kvs, res, T):
    att, layer = d.midlayer.self_attn, d.midlayer
    B = q.shape[0]
    out = torch.zeros(B, att.nh, T, att.hd, dtype=q.dtype)
    for i in range(T):
        keys = [kvs[0][0][:, :, : i + 1]] + [kv[0][:, :, i: i + 1] for kv in kvs[1:]]
        vals = [kvs[0][1][:, :, : i + 1]] + [kv[1][:, :, i: i + 1] for kv in kvs[1:]]
        keys, vals = torch.cat(keys, 2), torch.cat(vals, 2)  # [B, nh, i+1+k, hd]
        w = (q[:, :, i: i + 1] @ keys.transpose(-1, -2) / math.sqrt(att.hd)).softmax(-1)
        out[:, :, i] = (w @ vals)[:, :, 0]
    a = att.o_proj(out.transpose(1, 2).reshape(B, T, -1))
    r = res + a
    return r + layer.mlp(layer.post_attention_layernorm(r))


@pytest.mark.parametrize("nbr,norm_output", [(False, False), (True, False), (True, True)])
def test_ttt_unroll_equals_a_naive_loop(nbr, norm_output):
    d = tiny_draft(norm_before_residual=nbr, norm_output=norm_output).double()
    d.embed_tokens.double()
    B, T, K = 2, 6, 4
    ids = torch.randint(0, 50, (B, T))
    fused = torch.randn(B, T, 32, dtype=torch.double)
    cache, hidden, fast = [], fused, []
    for k in range(K):
        toks = torch.cat([ids[:, 1 + k:], torch.zeros(B, 1 + k, dtype=ids.dtype)], 1)
        pos = torch.arange(T)[None].expand(B, T) + k
        hidden, logits = d.step(toks, d.carry(hidden) if k else hidden, pos, cache)
        fast.append(logits)
    for k, (a, b) in enumerate(zip(fast, naive_unroll(d, ids, fused, K))):
        torch.testing.assert_close(a, b, msg=f"step {k} (norm_before_residual={nbr}, norm_output={norm_output})")
    if norm_output:  # the option changes what step 1 reads, so the logits from step 1 on
        plain = tiny_draft(norm_before_residual=nbr).double()
        plain.embed_tokens.double()
        assert not torch.allclose(naive_unroll(plain, ids, fused, K)[1], fast[1])


def test_norm_before_fc_norms_the_concatenated_states_before_fc():
    d = tiny_draft(norm_before_fc=True)
    aux = torch.randn(2, 5, 96) * torch.tensor([1.0] * 32 + [30.0] * 32 + [0.1] * 32)  # layers of unlike scale
    rms = aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + 1e-6) * d.input_norm.weight  # by hand
    torch.testing.assert_close(d.fuse(aux), d.fc(rms), atol=1e-5, rtol=1e-5)
    assert "input_norm.weight" in d.state_dict() and "input_norm.weight" not in tiny_draft().state_dict()


def test_training_step_masks_and_counts():
    d = tiny_draft()
    B, T, K = 2, 10, 3
    ids = torch.randint(0, 50, (B, T))
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask[:, 5:] = 1
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones(B, T, dtype=torch.long),
             "aux_hidden_states": torch.randn(B, T, 96)}
    target_p = torch.randn(B, T, 20).softmax(-1)
    in_vocab = torch.ones(B, T, dtype=torch.bool)
    m = training_step(d, batch, {"p": target_p, "in_vocab": in_vocab})
    # step k predicts token i+2+k: valid positions are those with i+2+k in [5, T)
    for k in range(K):
        expected = sum(1 for i in range(T) if 5 <= i + 2 + k < T) * B
        assert int(m.count[k]) == expected
    # a target top token outside the draft vocab is a miss, whatever the draft says
    none = training_step(d, batch, {"p": target_p, "in_vocab": torch.zeros(B, T, dtype=torch.bool)})
    assert int(none.correct.sum()) == 0 and torch.equal(none.count, m.count)
    m.loss.backward()
    assert d.fc.weight.grad is not None and d.lm_head.weight.grad is not None


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}])
def test_training_step_equals_the_dense_reference(norms):
    """The step runs the LM head only where the loss reads it (and the labels are made only
    there); loss, gradients and accuracy equal the dense computation over every position (with
    vLLM's three norm options too: input_norm gets its gradient)."""
    from trainer.drafts.eagle3 import shift_left

    torch.manual_seed(1)
    d = tiny_draft(**norms).double()
    d.embed_tokens.double()
    B, T, K = 3, 12, 3
    ids = torch.randint(0, 50, (B, T))
    loss_mask = (torch.rand(B, T) > 0.4).long()
    attn = torch.ones(B, T, dtype=torch.long)
    attn[2, 8:] = 0
    loss_mask[2, 8:] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attn,
             "aux_hidden_states": torch.randn(B, T, 96, dtype=torch.double)}
    p = torch.randn(B, T, 20, dtype=torch.double).softmax(-1)
    in_vocab = torch.rand(B, T) > 0.2
    m = training_step(d, batch, {"p": p, "in_vocab": in_vocab})
    m.loss.backward()
    fast = {n: q.grad.clone() for n, q in d.named_parameters() if q.grad is not None}
    d.zero_grad()
    hidden, cache, loss, correct = d.fuse(batch["aux_hidden_states"]), [], 0.0, []
    for k in range(K):  # the dense reference: logits and labels at every position, then masked
        valid = shift_left(loss_mask, 2 + k).bool() & attn.bool()
        carried = (d.norm(hidden) if norms else hidden) if k else hidden  # norm_output: the normed state on
        hidden, logits = d.step(shift_left(ids, 1 + k), carried, torch.arange(T).expand(B, T) + k, cache)
        target = shift_left(p, 1 + k)
        per_pos = -(target * logits.log_softmax(-1)).sum(-1)  # [B, T]
        per_sample = (per_pos * valid).sum(-1) / valid.sum(-1).clamp(min=1)  # each sample's mean, then the batch's
        loss = loss + d.config.step_decay ** k * per_sample.mean()
        correct.append(int(((logits.argmax(-1) == target.argmax(-1)) & valid & shift_left(in_vocab, 1 + k)).sum()))
    loss.backward()
    torch.testing.assert_close(m.loss, loss.float() if m.loss.dtype == torch.float32 else loss)
    for n, q in d.named_parameters():
        if q.grad is not None:
            torch.testing.assert_close(fast[n], q.grad, msg=n)
    assert m.correct.tolist() == correct
    assert ("input_norm.weight" in fast) == bool(norms)


def test_default_layer_ids_are_valid_for_every_depth():
    assert default_layer_ids(30) == [2, 15, 27]  # vLLM's (2, L//2, L-3)
    assert default_layer_ids(32) == [2, 16, 29]  # Llama-3.1-8B, as vLLM computes it
    assert default_layer_ids(4) == [1, 2, 3]  # vLLM's formula gives [2, 2, 1] here: not servable
    for L in range(2, 80):
        ids = default_layer_ids(L)
        assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] <= L, (L, ids)


def test_simulated_tau():
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.0, 1.0]) == 1.0
    assert math.isclose(simulated_tau([0.5, 0.5]), 1 + 0.5 + 0.25)


def test_chunked_attention_and_loss_equal_one_pass():
    """Long samples (issue 43): the TTT attention in query blocks and the loss in row chunks, each
    recomputed in backward, with or without activation checkpointing, give the one-pass loss,
    gradients, accuracy and acceptance. Chunks of 5 over T = 12 leave a short last block."""
    torch.manual_seed(2)
    B, T = 2, 12
    ids = torch.randint(0, 50, (B, T))
    loss_mask = (torch.rand(B, T) > 0.3).long()
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 9:] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attn,
             "aux_hidden_states": torch.randn(B, T, 96, dtype=torch.double),
             "target_argmax": torch.randint(0, 50, (B, T))}
    labels = {"p": torch.randn(B, T, 20, dtype=torch.double).softmax(-1), "in_vocab": torch.rand(B, T) > 0.2}
    results = []
    for attention_chunk, loss_chunk_rows, ckpt in ((0, 0, False), (5, 5, False), (5, 5, True), (4, 0, True)):
        d = tiny_draft().double()
        d.embed_tokens.double()
        d.set_vocab(torch.zeros(20, dtype=torch.int64), torch.arange(50) < 20)
        d.config.attention_chunk = d.midlayer.self_attn.chunk = attention_chunk
        d.config.loss_chunk_rows, d.config.loss = loss_chunk_rows, "fkl:0.5,ce:0.2,lk_hybrid:0.3"
        d.gradient_checkpointing = ckpt
        m = training_step(d.train(), batch, labels)
        m.loss.backward()
        results.append((m, {n: q.grad.clone() for n, q in d.named_parameters() if q.grad is not None}))
    (m0, g0), rest = results[0], results[1:]
    assert "midlayer.self_attn.q_proj.weight" in g0 and "lm_head.weight" in g0
    for m, g in rest:
        torch.testing.assert_close(m.loss, m0.loss)
        torch.testing.assert_close(m.alpha, m0.alpha)
        assert torch.equal(m.correct, m0.correct) and torch.equal(m.count, m0.count) and g.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], msg=name)


def test_negative_chunks_are_refused():
    from trainer.config import load_section

    for name in ("loss_chunk_rows", "attention_chunk"):
        with pytest.raises(ConfigError, match=f"draft.{name}=-1; use >= 0 "):
            load_section(Eagle3Config, {name: -1}, "draft")


def test_loss_on_all_trains_every_real_position(tiny_target):
    """`loss_on: all` trains where the sample is real, prompt included: its labels and its step equal
    `loss_on: assistant` given a loss mask that covers the whole sample; and they differ from the
    assistant-only step on the sample as written (the setting does something)."""
    import dataclasses

    from trainer.capture import capture_batch
    from trainer.drafts import eagle3
    from trainer.drafts.registry import build

    cfg = eagle3.Config(ttt_steps=3, draft_vocab_size=None).fill_from_target(
        tiny_target.model.config, [1, 2, 3], tiny_target.vocab_size)
    ids = torch.arange(5, 45).reshape(2, 20)
    attn = torch.ones_like(ids)
    attn[1, 15:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :8] = 0
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
             **capture_batch(tiny_target, ids, attn, cfg.aux_layer_ids)}
    every = {**batch, "loss_mask": attn.clone()}
    runs = {}
    for name, loss_on, b in (("all", "all", batch), ("assistant, all masked in", "assistant", every),
                             ("assistant", "assistant", batch)):
        torch.manual_seed(0)
        draft = build("eagle3", dataclasses.replace(cfg, loss_on=loss_on), tiny_target)
        draft.set_vocab(torch.zeros(tiny_target.vocab_size, dtype=torch.long),
                        torch.ones(tiny_target.vocab_size, dtype=torch.bool))
        labels = eagle3.target_labels(tiny_target, b, draft)
        m = eagle3.training_step(draft, b, labels)
        m.loss.backward()
        runs[name] = (labels["p"], m, {n: p.grad for n, p in draft.named_parameters() if p.grad is not None})
    (p_all, m_all, g_all), (p_ref, m_ref, g_ref), (_, m_asst, _) = runs.values()
    assert torch.equal(p_all, p_ref) and torch.equal(m_all.count, m_ref.count)
    torch.testing.assert_close(m_all.loss, m_ref.loss)
    for n in g_ref:
        torch.testing.assert_close(g_all[n], g_ref[n], msg=n)
    assert (m_all.count > m_asst.count).all()  # step k: positions i with i+2+k a real token, not only an answer's
    assert m_all.count.tolist() == [sum(max(n - 2 - k, 0) for n in (20, 15)) for k in range(3)]
