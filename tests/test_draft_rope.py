"""A draft for a target with a scaled RoPE (Llama-3.x's `llama3`, YaRN, linear, dynamic) is a
draft like any other after training: the shape check of a trained draft folder builds it on the
meta device (trainer/drafts/folder.py module_shapes), and its rotary table is computed on the
CPU there too (trainer/drafts/layers.py Rotary), equal to the one built on the CPU."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from tests.conftest import REPO
from tests.test_contract import ALGORITHMS, tiny_config
from trainer.drafts.folder import module_shapes, read_draft, save_draft
from trainer.drafts.layers import Rotary
from trainer.drafts.registry import get

ROPES = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def target_config(rope: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       rope_parameters=dict(ROPES[rope]))


@pytest.mark.parametrize("rope", list(ROPES))
def test_a_scaled_rotary_table_is_computed_on_the_cpu_under_the_meta_device(rope):
    args = (32, ROPES[rope], 512, 128, 4)
    with torch.device("meta"):
        meta = Rotary(*args)
    cpu = Rotary(*args)
    assert meta.inv_freq.device.type == "cpu"
    torch.testing.assert_close(meta.inv_freq, cpu.inv_freq, rtol=0, atol=0)
    assert meta.scale == cpu.scale


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_trained_draft_of_a_scaled_rope_target_reads_back(algorithm, rope, tmp_path):
    """module_shapes (meta device) builds the draft, and a trained draft folder of that config
    is read back (what export, eval and load_draft do first)."""
    cfg = tiny_config(algorithm, target_config(rope), data_vocab_size=64)
    assert cfg.rope_parameters["rope_type"] == rope
    d = dataclasses.asdict(cfg)
    shapes = module_shapes(algorithm, d)
    draft = get(algorithm).Draft(cfg)
    state = draft.state_dict()
    assert shapes == {k: tuple(v.shape) for k, v in state.items()}
    target = SimpleNamespace(name="tiny", spec="tiny", path="tiny", content_hash="0" * 64, num_layers=4,
                             hidden_size=128, vocab_size=256)
    (tmp_path / "draft").mkdir()
    save_draft(tmp_path / "draft", algorithm, draft, state, target, {"name": "data"}, steps=1)
    read, tensors = read_draft(tmp_path / "draft")
    assert read["draft"]["rope_parameters"]["rope_type"] == rope and set(tensors) == set(state)


def test_the_llama_3_1_recipes_draft_builds_for_its_shape_check():
    """recipes/configs/llama-3.1-8b-instruct/eagle3.yaml's draft (rope llama3), with the layer ids
    and draft vocabulary its header says to capture with: the shape check of its trained folder
    builds it (on the meta device: no memory for the 8B-shaped layers)."""
    recipe = OmegaConf.to_container(OmegaConf.load(REPO / "recipes/configs/llama-3.1-8b-instruct/eagle3.yaml"))
    assert recipe["draft"]["rope_parameters"]["rope_type"] == "llama3"
    cfg = get("eagle3").Config(**recipe["draft"], aux_layer_ids=[2, 16, 29], draft_vocab_size=32000)
    cfg.validate()
    shapes = module_shapes("eagle3", dataclasses.asdict(cfg))
    assert shapes["fc.weight"] == (4096, 3 * 4096) and shapes["lm_head.weight"] == (32000, 4096)
