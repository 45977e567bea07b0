"""The second embedded target, Gemma-3-270M (base), end to end on a minimal budget: prepare in
Gemma's turn format (it ships no chat template), capture, EAGLE-3 and DFlash training, export
without naming the target again (the draft knows it), eval in-tree with the data's template
and with plain prompts; the servability check says at capture, train and export that stock vLLM
0.32 cannot serve drafts for Gemma-3 and that draftsmith's vLLM plugin makes it (or, with the
plugin installed, that it serves them), and vLLM's own draft classes build each export with
every weight (the flat RoPE a per-layer-type target needs)."""

import json

import pytest
import torch

from recipes import capture, prepare, train
from recipes import eval as eval_recipe
from recipes import export_draft as export_recipe
from tests.conftest import REPO
from trainer.config import TrainConfig, load_config

pytestmark = pytest.mark.slow
CONFIGS = REPO / "recipes" / "configs" / "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma():
    from trainer.target import load_target

    return load_target("gemma-3-270m")


@pytest.fixture(scope="module")
def run(tmp_path_factory, gemma):
    import contextlib
    import io

    d = tmp_path_factory.mktemp("gemma")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        prepare.main(["--config", str(CONFIGS / "prepare.yaml"), f"output_dir={d / 'prepared'}", "max_records=60",
                      "max_length=512"])
        capture.main(["--config", str(CONFIGS / "capture.yaml"), f"data={d / 'prepared'}",
                      f"output_dir={d / 'capture'}", "max_samples=6", "samples_per_shard=8"])
        for algorithm in ("eagle3", "dflash"):
            train.run(load_config(TrainConfig, CONFIGS / f"{algorithm}.yaml", [
                f"data={d / 'capture'}", f"output_dir={d / algorithm}", "max_steps=4", "gradient_accumulation_steps=1",
                "max_length=512", "log_every=2", "save_every=1000", "warmup_steps=1",
                *(["draft.num_anchors=16"] if algorithm == "dflash" else [])]))
            export_recipe.main(["--draft", str(d / algorithm), "--output-dir", str(d / f"{algorithm}-bf16")])
    return d, err.getvalue()


def test_the_data_keeps_its_template_and_the_capture_its_layers(run, gemma):
    d, _ = run
    s = json.loads((d / "prepared" / "summary.json").read_text())
    assert s["chat_template"] == (CONFIGS / "turns.jinja").read_text() and s["kept"] >= 6
    m = json.loads((d / "capture" / "manifest.json").read_text())
    assert m["aux_layer_ids"] == [2, 5, 9, 13, 15, 16] and m["target"]["num_layers"] == 18
    assert m["data"]["chat_template"] == s["chat_template"]
    assert 0 < m["draft_vocab"]["coverage"] <= 1 and m["draft_vocab"]["size"] == 8192  # of the 262,144 tokens


def test_servability_says_what_serves_it_at_every_stage(run):
    """Stock vLLM 0.32 cannot serve Gemma-3 drafts (Gemma3ForCausalLM lacks SupportsEagle3): capture,
    train and export say so, naming draftsmith's vLLM plugin and how to install it, and
    require_servable=true refuses. With the plugin installed beside vLLM (scripts/setup_vllm.sh,
    as in CI) every stage says it is served with the plugin, and require_servable=true passes."""
    from tests.test_target_families import PLUGIN

    d, err = run
    for algorithm in ("eagle3", "dflash"):
        m = json.loads((d / f"{algorithm}-bf16" / "draftsmith_export.json").read_text())
        assert m["servable"]["servable"] is PLUGIN and "Gemma3ForCausalLM" in m["servable"]["line"]
        assert "draftsmith's vLLM plugin" in m["servable"]["line"]
        assert m["target"]["spec"] == "gemma-3-270m"  # recorded by its alias: what eval loads by default
    strict = ["max_steps=1", "require_servable=true", "save_every=1000", "warmup_steps=1", "max_length=512"]
    if PLUGIN:
        assert "SupportsEagle3" not in err  # no warning at capture or train
        train.run(load_config(TrainConfig, CONFIGS / "eagle3.yaml", [
            f"data={d / 'capture'}", f"output_dir={d / 'strict'}", *strict]))
        assert (d / "strict" / "model.safetensors").is_file()
        return
    assert err.count("Gemma3ForCausalLM does not implement SupportsEagle3") >= 3  # capture (x2 drafts), train x2
    assert "draftsmith's vLLM plugin adds it: pip install" in err
    with pytest.raises(Exception, match="cannot serve eagle3 drafts for this target"):
        train.run(load_config(TrainConfig, CONFIGS / "eagle3.yaml", [
            f"data={d / 'capture'}", f"output_dir={d / 'refused'}", *strict]))
    assert not (d / "refused").exists()


def test_exports_carry_a_flat_rope_and_the_drafts_embed_as_vllm(run, gemma):
    d, _ = run
    for algorithm, key in (("eagle3", "rope_parameters"), ("dflash", "rope_parameters")):
        cfg = json.loads((d / f"{algorithm}-bf16" / "config.json").read_text())
        assert cfg[key] == {"rope_theta": 1000000.0, "rope_type": "default"}, cfg[key]  # the full-attention layers'
        assert cfg["hidden_act"] == "silu" and cfg["vocab_size"] == 262144


def test_eval_uses_the_datas_template_and_takes_plain_prompts(run, gemma, tmp_path):
    d, _ = run
    r = eval_recipe.run(eval_recipe.EvalConfig(draft=str(d / "eagle3-bf16"), dataset="mtbench", num_prompts=1,
                                               max_new_tokens=12, output_dir=str(tmp_path / "chat")))
    assert r["target"] == "google/gemma-3-270m" and r["num_draft_tokens"] == 3
    assert r["speculative"]["tokens"] == r["autoregressive"]["tokens"]  # lossless on Gemma's sliding windows
    plain = eval_recipe.run(eval_recipe.EvalConfig(draft=str(d / "dflash"), dataset="gsm8k", num_prompts=2,
                                                   max_new_tokens=12, no_chat_template=True, batch_size=2,
                                                   output_dir=str(tmp_path / "plain")))
    assert plain["num_draft_tokens"] == 7 and plain["speculative"]["tokens"] == plain["autoregressive"]["tokens"]
    # a target without a template, a draft that records none: one line, no traceback
    with pytest.raises(SystemExit) as e:
        eval_recipe.main(["--target", "gemma-3-270m", "--draft", "ngram", "--num-prompts", "1",
                          f"output_dir={tmp_path / 'none'}"])
    assert e.value.code == 2


@pytest.mark.extended  # every served family's exports are built by vLLM in tests/test_target_families.py
def test_vllm_builds_both_exports_with_every_weight(run, gemma):
    from export import formats
    from tests.conftest import require_vllm, vllm_build_many

    require_vllm()
    d, _ = run
    prompt = gemma.tokenizer("The capital of France is")["input_ids"]
    exports = [d / f"{algorithm}-bf16" for algorithm in ("eagle3", "dflash")]
    for export_dir, (_, got, aux) in zip(exports, vllm_build_many([(gemma, e) for e in exports], d, prompt)):
        _, ours = formats.load_export(export_dir, gemma)
        fc = ours.fc(aux.to(ours.fc.weight.dtype))
        torch.testing.assert_close(got["fc"], fc.float(), atol=2e-2, rtol=2e-2)  # BF16 weights both sides
