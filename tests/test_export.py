"""`draftsmith export` on a tiny trained draft: strict one-to-one key maps, bit-identical
round trips in both vLLM layouts, refusals (wrong target, existing folder), and FP8 with
the real AMD Quark: which layers are FP8, the `exclude` rewrite vLLM needs, the τ gate."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from export import formats, quark
from recipes import export_draft as export_recipe
from recipes import train
from tests.conftest import REPO, make_tiny_model
from trainer.config import ExportConfig, TrainConfig, load_config
from trainer.errors import DraftsmithError

TINY = REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml"
FP8_LINEARS = ["midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
               "midlayer.self_attn.o_proj", "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", "midlayer.mlp.down_proj"]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, tiny_target_dir, tiny_target, gate_prompts):
    """A tiny draft trained on the tiny target's own greedy tokens after GOOD_CHATS prompts,
    so that it accepts well when that target decodes those prompts (what the FP8 gate
    measures). The tokens are spliced in as ids: the random tiny target's text would not
    survive a decode/re-tokenize round trip, as `regenerate` does it."""

    from recipes import capture, prepare
    from tests.conftest import GOOD_CHATS, splice_prepared, write_jsonl
    from trainer.config import CaptureConfig, PrepareConfig
    from trainer.data.evalsets import load_prompts
    from trainer.speculative import generate

    d = tmp_path_factory.mktemp("export")
    src = write_jsonl(d / "chats.jsonl", GOOD_CHATS)
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target=str(tiny_target_dir), source=str(src),
                              max_length=256))
    tok = tiny_target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for p in load_prompts(gate_prompts, 4)]
    answers, _ = generate(tiny_target, prompts, 64, None)
    rows = {"input_ids": [p + a for p, a in zip(prompts, answers)],
            "loss_mask": [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]}
    splice_prepared(d / "prepared", rows)
    capture.run(CaptureConfig(data=str(d / "prepared"), output_dir=str(d / "capture"), target=str(tiny_target_dir),
                              samples_per_shard=8, draft_vocab_size=320, store_dtype="float32"))  # Vd = V
    out = d / "eagle3"
    train.run(load_config(TrainConfig, TINY, [f"data={d / 'capture'}", f"target={tiny_target_dir}",
                                              f"output_dir={out}", "max_steps=150", "epochs=200", "log_every=20",
                                              "batch_size=1",
                                              "save_every=1000"]))
    return out


@pytest.fixture(scope="module")
def gate_prompts(tmp_path_factory):
    """The chats the tiny draft was trained on: the only text on which it predicts the tiny target."""
    from tests.conftest import GOOD_CHATS, write_jsonl

    return "jsonl:" + str(write_jsonl(tmp_path_factory.mktemp("gate") / "prompts.jsonl", GOOD_CHATS))


def _export(draft, target_dir, out, *extra):
    export_recipe.main(["--draft", str(draft), "--target", str(target_dir), "--output-dir", str(out), *extra])
    return json.loads((out / formats.EXPORT_MANIFEST).read_text())


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_round_trip_is_bit_identical(tmp_path, tiny_draft, tiny_target_dir, fmt):
    out = tmp_path / fmt
    m = _export(tiny_draft, tiny_target_dir, out, "--format", fmt, "--dtype", "float32")
    trained = load_file(tiny_draft / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in written  # shared with the target
    back = formats.draft_state_from_export(out)
    assert back.keys() == trained.keys()
    for k in trained:
        assert back[k].dtype == trained[k].dtype and torch.equal(back[k], trained[k]), k
    cfg = json.loads((out / "config.json").read_text())
    d = m["draft"]
    if fmt == "vllm":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "midlayer.fc" not in written
        assert set(written) == {  # vLLM's LlamaForCausalLMEagle3 names (llama_eagle3.py), no embedding
            "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
        layer = cfg
    else:
        assert cfg["speculators_model_type"] == "eagle3"
        spec = cfg["speculators_config"]  # the four fields vLLM's validator requires
        assert spec["proposal_methods"][0]["speculative_tokens"] == 3
        assert spec["verifier"]["name_or_path"] and spec["default_proposal_method"] == "greedy"
        assert all(k.startswith(("layers.0.", "fc.", "norm.", "lm_head.", "d2t", "t2d")) for k in written)
        layer = cfg["transformer_layer_config"]
    # vLLM reads the layer ids only at the top level, in its own convention; both norms explicit
    assert cfg["eagle_aux_hidden_state_layer_ids"] == d["aux_layer_ids"]
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False and cfg["norm_output"] is False
    assert cfg["draft_vocab_size"] == d["draft_vocab_size"] and cfg["target_hidden_size"] == 64
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == d["hidden_size"]


def test_bf16_export_and_strict_reload(tmp_path, tiny_draft, tiny_target_dir, tiny_target):
    out = tmp_path / "bf16"
    m = _export(tiny_draft, tiny_target_dir, out)
    written = load_file(out / "model.safetensors")
    assert written["fc.weight"].dtype == torch.bfloat16 and written["d2t"].dtype == torch.int64
    for name, info in m["files"].items():  # the manifest describes every file exactly
        assert (out / name).stat().st_size == info["bytes"]
    assert {"config.json", "model.safetensors", "train_report.json", "provenance.json"} <= set(m["files"])
    assert formats.load_export(out, tiny_target) is not None
    # one tensor renamed: the file no longer matches its sha256 in the manifest
    written["midlayer.mlp.up_proj.weightx"] = written.pop("midlayer.mlp.up_proj.weight")
    save_file(written, str(out / "model.safetensors"))
    with pytest.raises(DraftsmithError, match=r"model.safetensors does not match its sha256"):
        formats.load_export(out, tiny_target)
    # and with the manifest rewritten to match, strict loading names the tensor
    formats.write_manifest(out, {k: v for k, v in m.items() if k != "files"})
    with pytest.raises(DraftsmithError, match=r"missing \['midlayer.mlp.up_proj.weight'\].*unexpected"):
        formats.load_export(out, tiny_target)


def test_refuses_existing_output_and_other_target(tmp_path, tiny_draft, tiny_target_dir, tiny_tokenizer, capsys):
    out = tmp_path / "e"
    _export(tiny_draft, tiny_target_dir, out)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as e:
        _export(tiny_draft, tiny_target_dir, out)
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    _export(tiny_draft, tiny_target_dir, out, "--overwrite")

    other = tmp_path / "other-target"  # same shapes, other weights: only the hash tells them apart
    make_tiny_model(len(tiny_tokenizer), seed=1).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    with pytest.raises(SystemExit) as e:
        _export(tiny_draft, other, tmp_path / "wrong")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(errors) == 1 and "was trained for" in errors[0] and "sha256" in errors[0]
    assert not (tmp_path / "wrong").exists() and not list(tmp_path.glob(".wrong*"))

    deeper = tmp_path / "deeper-target"  # more layers: the layer-count check names it
    make_tiny_model(len(tiny_tokenizer), num_layers=6).save_pretrained(deeper)
    tiny_tokenizer.save_pretrained(deeper)
    with pytest.raises(DraftsmithError, match="num_layers 4 != 6"):
        export_recipe.run(ExportConfig(draft=str(tiny_draft), output_dir=str(tmp_path / "w2"), target=str(deeper)))


def test_vllm_exclude_patterns_match_runtime_names():
    import re

    from export import eagle3

    keep = eagle3.keep_bf16({}, quantize_fc=False)
    assert keep == {"fc": "model.fc", "lm_head": "lm_head"}
    assert eagle3.keep_bf16({}, quantize_fc=True) == {"lm_head": "lm_head"}
    pats = quark.vllm_exclude(sorted(keep.values()))

    def ignored(name):  # vLLM: exact name, or re.match for "re:" entries (quantization/utils/config_utils.py)
        return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in pats)

    assert all(ignored(runtime) for runtime in keep.values())
    assert not ignored("model.layers.4.self_attn.qkv_proj") and not ignored("model.layers.4.mlp.gate_up_proj")
    assert not ignored("model.layers.4.mlp.down_proj") and not ignored("model.fc_norm")
    with pytest.raises(DraftsmithError, match="did not record"):
        quark.rewrite_exclude(["lm_head"], keep)
    # q/k/v kept BF16: every shard of the fused qkv_proj of any draft layer index, nothing else
    qkv = quark.vllm_exclude(sorted(eagle3.keep_bf16({}, quantize_qkv=False).values()))
    for shard in ("q_proj", "k_proj", "v_proj"):
        assert any(re.match(p[3:], f"model.layers.30.self_attn.{shard}") for p in qkv)
    assert not any(re.match(p[3:], "model.layers.30.self_attn.o_proj") for p in qkv)


@pytest.mark.slow
def test_fp8_export_with_quark(tmp_path, tiny_draft, tiny_target_dir, tiny_target, gate_prompts):
    out = tmp_path / "fp8"
    m = _export(tiny_draft, tiny_target_dir, out, "--quantize", "fp8", "--gate-dataset", gate_prompts,
                "--gate-prompts", "4")
    w = load_file(out / "model.safetensors")
    for layer in FP8_LINEARS:  # the decoder layer's Linears: FP8 with one scale per output channel
        assert w[f"{layer}.weight"].dtype == torch.float8_e4m3fn
        assert w[f"{layer}.weight_scale"].numel() == w[f"{layer}.weight"].shape[0]
    for name in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.input_layernorm.weight"):
        assert w[name].dtype == torch.bfloat16, name
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "quark" and "export" in q
    assert q["exclude"] == quark.vllm_exclude(["lm_head", "model.fc"])  # never Quark's bare names
    assert q["global_quant_config"]["input_tensors"]["is_dynamic"] is True
    assert m["quantization"]["scheme"] == "ptpc_fp8" and m["size"]["fp8_bytes"] < m["size"]["bf16_bytes"]
    g = m["gate"]
    assert g["tau_bf16"] > 1.1 and abs(g["relative_change"]) <= 0.05
    # the dequantized FP8 weights are within FP8 rounding of the BF16 ones
    _, fp8 = formats.load_export(out, tiny_target)
    src = load_file(tiny_draft / "model.safetensors")
    got = fp8.midlayer.mlp.down_proj.linear.weight.float()
    ref = src["midlayer.mlp.down_proj.weight"].float()
    assert (got - ref).abs().max() <= ref.abs().amax(dim=1, keepdim=True).max() / 16


@pytest.mark.slow
def test_fp8_gate_refuses_an_activation_outlier(tmp_path, tiny_draft, tiny_target_dir, gate_prompts, capsys):
    """A draft whose q/k/v input has one huge channel that its weights ignore: exact in
    BF16, but per-token FP8 activations round every other channel to zero."""
    bad = tmp_path / "outlier"
    shutil.copytree(tiny_draft, bad)
    w = load_file(bad / "model.safetensors")
    w["midlayer.input_layernorm.weight"][0] = 1e6
    for p in ("q_proj", "k_proj", "v_proj"):
        w[f"midlayer.self_attn.{p}.weight"][:, 0] = 0.0
    save_file(w, str(bad / "model.safetensors"))
    cfg = json.loads((bad / "config.json").read_text())  # this draft is made by hand: record its weights
    cfg["weights_sha256"] = hashlib.sha256((bad / "model.safetensors").read_bytes()).hexdigest()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        _export(bad, tiny_target_dir, tmp_path / "fp8", "--quantize", "fp8", "--gate-dataset", gate_prompts,
                "--gate-prompts", "4")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "FP8 gate failed" in err and "Nothing was written" in err
    assert not (tmp_path / "fp8").exists()


def test_export_is_readable_by_other_users(tmp_path, tiny_draft, tiny_target_dir):
    """vLLM often runs as another user: the folder and files get the umask's mode, not 0700/0600."""
    out = tmp_path / "perm"
    old = os.umask(0o022)
    try:
        _export(tiny_draft, tiny_target_dir, out)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir() if p.is_file())
