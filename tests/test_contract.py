"""The draft contract (trainer/drafts/__init__.py), held for every registered algorithm: the
training and export registries agree, each module exposes the contract's names, the module's
state dict is exactly what every export format writes (one to one), what stays BF16 under
Quark is in the file, the default layer ids are valid for every depth, and the training
step measures K = Config.num_positions positions. A fourth algorithm is held to the same."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from export import formats
from tests.conftest import REPO
from trainer.drafts.registry import DRAFTS, build, get

ALGORITHMS = sorted(DRAFTS)
CONTRACT = ("Config", "default_layer_ids", "Draft", "fill_from_data", "target_labels", "training_step", "Proposer")
EXPORTER = ("METHOD", "TITLE", "FORMATS", "FP8_FORMATS", "OPTIONS", "key_map", "config_json", "keep_bf16", "describe")


def tiny_config(algorithm, target_config, data_vocab_size=None, **extra):
    """The draft section of recipes/configs/tiny/<algorithm>.yaml, filled from a target."""
    section = OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "configs" / "tiny" / f"{algorithm}.yaml"))
    algo = get(algorithm)
    cfg = algo.Config(**{**section.get("draft", {}), **extra})
    cfg = cfg.fill_from_target(target_config, algo.default_layer_ids(target_config.num_hidden_layers),
                               data_vocab_size)
    if "mask_token_id" in {f.name for f in dataclasses.fields(cfg)} and cfg.mask_token_id is None:
        cfg.mask_token_id = target_config.vocab_size - 1
    cfg.validate()
    return cfg


def test_the_training_and_export_registries_hold_the_same_algorithms():
    assert set(DRAFTS) == set(formats.EXPORTERS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_module_exposes_the_contract(algorithm):
    algo, ex = get(algorithm), formats.exporter(algorithm)
    missing = [n for n in CONTRACT if not hasattr(algo, n)] + [f"export.{n}" for n in EXPORTER if not hasattr(ex, n)]
    assert not missing, missing
    cfg = algo.Config()
    assert callable(cfg.validate) and hasattr(type(cfg), "num_positions") and hasattr(type(cfg), "max_draft_tokens")
    for name in ("OPTIONS", "ABLATIONS", "parallel"):
        assert hasattr(algo.Proposer, name), name
    # every option an export serves can be measured in-tree, and every ablation is made of options
    assert set(ex.OPTIONS) <= set(algo.Proposer.OPTIONS)
    assert all(set(opts) <= set(algo.Proposer.OPTIONS) for opts in algo.Proposer.ABLATIONS.values())
    assert ex.METHOD and set(ex.FP8_FORMATS) <= set(ex.FORMATS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("vocab", [None, 96])
def test_state_dict_is_what_every_format_writes(algorithm, vocab, tiny_target):
    """The module built on the meta device from a tiny config: its state-dict keys are the key
    map's, one to one, for every format; the BF16-under-Quark layers are in the file."""
    cfg = tiny_config(algorithm, tiny_target.model.config, data_vocab_size=128, draft_vocab_size=vocab)
    with torch.device("meta"):
        module = get(algorithm).Draft(cfg)
    keys = set(module.state_dict())
    d = dataclasses.asdict(cfg)
    ex = formats.exporter(algorithm)
    for fmt in ex.FORMATS:
        mapping = formats.key_map(algorithm, fmt, d)
        assert set(mapping) == keys, fmt
        assert len(set(mapping.values())) == len(mapping), f"{fmt}: two tensors under one name"
    written = set(formats.key_map(algorithm, "vllm", d).values())
    for quantize_qkv in (True, False):
        for name in ex.keep_bf16(d, quantize_fc=False, quantize_qkv=quantize_qkv):
            assert f"{name}.weight" in written, (name, quantize_qkv)
    # the shape check of a trained draft folder builds the same module
    from trainer.drafts.folder import module_shapes

    assert set(module_shapes(algorithm, d)) == keys


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_default_layer_ids_are_valid_for_every_depth(algorithm):
    for L in range(4, 81):
        ids = get(algorithm).default_layer_ids(L)
        assert ids and all(a < b for a, b in zip(ids, ids[1:])) and 0 <= ids[0] and ids[-1] <= L, (L, ids)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_training_step_measures_num_positions(algorithm, tiny_target):
    from trainer.capture import capture_batch

    algo = get(algorithm)
    cfg = tiny_config(algorithm, tiny_target.model.config, data_vocab_size=tiny_target.vocab_size)
    draft = build(algorithm, cfg, tiny_target)
    ids = torch.arange(5, 45).reshape(2, 20)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
             **capture_batch(tiny_target, ids, attn, cfg.aux_layer_ids)}
    torch.manual_seed(0)
    m = algo.training_step(draft, batch, algo.target_labels(tiny_target, batch, draft))
    K = cfg.num_positions
    assert m.loss.dim() == 0 and m.position_loss.shape == m.correct.shape == m.count.shape == (K,)
    assert cfg.max_draft_tokens is None or cfg.max_draft_tokens >= K  # the served N fits what was trained


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradient_checkpointing_changes_memory_not_results(algorithm, tiny_target):
    """`gradient_checkpointing: true` (recipes/train.py sets draft.gradient_checkpointing)
    recomputes parts in backward: the same loss and gradients, for every algorithm."""
    from trainer.capture import capture_batch

    algo = get(algorithm)
    cfg = tiny_config(algorithm, tiny_target.model.config, data_vocab_size=tiny_target.vocab_size)
    ids = torch.arange(5, 45).reshape(2, 20)
    attn = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone(),
             **capture_batch(tiny_target, ids, attn, cfg.aux_layer_ids)}
    runs, recomputed = [], []
    for on in (False, True):
        torch.manual_seed(0)
        draft = build(algorithm, cfg, tiny_target).train()
        draft.gradient_checkpointing = on
        calls = []
        hook = torch.utils.checkpoint  # count the recomputed regions: the switch must do something
        real = hook.checkpoint
        hook.checkpoint = lambda *a, calls=calls, real=real, **k: calls.append(1) or real(*a, **k)
        try:
            torch.manual_seed(1)
            m = algo.training_step(draft, batch, algo.target_labels(tiny_target, batch, draft))
            m.loss.backward()
        finally:
            hook.checkpoint = real
        recomputed.append(len(calls))
        runs.append((m.loss.detach(), {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}))
    assert recomputed[0] == 0 < recomputed[1], recomputed
    torch.testing.assert_close(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys()
    for name in runs[0][1]:
        torch.testing.assert_close(runs[0][1][name], runs[1][1][name], msg=name)
