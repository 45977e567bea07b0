import pytest
import torch

from trainer.errors import TargetError
from trainer.layer_ids import entering_to_output, output_to_entering
from trainer.target import Target, load_target, resolve_target


def _hf_hidden_states(target, ids):
    with torch.no_grad():
        return target.model(ids, output_hidden_states=True)


def test_aux_states_are_hf_hidden_states_entering_each_layer(tiny_target):
    ids = torch.randint(3, tiny_target.vocab_size, (2, 11))
    ref = _hf_hidden_states(tiny_target, ids)
    L = tiny_target.num_layers
    out = tiny_target.forward(ids, aux_layer_ids=[0, 1, L - 1])
    H = tiny_target.hidden_size
    for k, i in enumerate([0, 1, L - 1]):  # vLLM convention: entering layer i = HF hidden_states[i]
        torch.testing.assert_close(out.aux_hidden_states[..., k * H:(k + 1) * H], ref.hidden_states[i])
    torch.testing.assert_close(out.logits, ref.logits)


def test_last_layer_is_never_taken_after_the_final_norm(tiny_target):
    ids = torch.randint(3, tiny_target.vocab_size, (1, 9))
    ref = _hf_hidden_states(tiny_target, ids)
    L = tiny_target.num_layers
    out = tiny_target.forward(ids, aux_layer_ids=[L])
    # HF's last entry is normed; ours is the residual stream leaving the last layer.
    assert not torch.allclose(out.last_hidden_state, ref.hidden_states[L], atol=1e-3)
    torch.testing.assert_close(tiny_target.backbone.norm(out.last_hidden_state), ref.hidden_states[L])
    torch.testing.assert_close(out.aux_hidden_states, out.last_hidden_state)  # id L is the pre-norm output
    torch.testing.assert_close(tiny_target.logits_from_last_hidden(out.last_hidden_state), ref.logits)


def test_target_is_frozen_and_in_eval_mode(tiny_target):
    assert not tiny_target.model.training
    assert not any(p.requires_grad for p in tiny_target.model.parameters())


def test_layer_id_conventions():
    assert output_to_entering(1) == 2 and entering_to_output(2) == 1
    with pytest.raises(ValueError):
        entering_to_output(0)


def test_out_of_range_layer_ids_are_one_clear_error(tiny_target):
    with pytest.raises(TargetError, match=r"valid ids are 0..4"):
        tiny_target.forward(torch.ones(1, 3, dtype=torch.long), aux_layer_ids=[5])


def test_unknown_target_spec_is_one_clear_error(tmp_path):
    with pytest.raises(TargetError, match="neither an embedded alias"):
        resolve_target(str(tmp_path / "nope"))


def test_dtype_choice(tiny_target_dir):
    t = load_target(str(tiny_target_dir), dtype="bfloat16")
    assert isinstance(t, Target) and t.dtype == torch.bfloat16
    assert len(t.content_hash) == 64


@pytest.mark.slow
def test_smollm2_embedded_target_loads_from_the_package(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    assert smollm2.eos_token_ids == [2]  # <|im_end|>: the tokenizer's and the generation config's
    assert smollm2.dtype == torch.float32
    assert resolve_target("smollm2-135m-instruct").kind == "gguf"


@pytest.mark.slow
def test_a_gguf_targets_license_is_its_own_read_once_at_conversion(smollm2, tmp_path):
    """The license a GGUF target carries (its `general.license`) is what its conversion recorded
    (read again only where no record of this very file is there: parsing the GGUF's metadata
    costs ~20 s for Gemma-3's 262k tokens, once per stage otherwise)."""
    import json

    from trainer.target import converted_license, read_license

    source = resolve_target("smollm2-135m-instruct")
    assert smollm2.license == read_license(source) == "apache-2.0"
    record = {"sha256": smollm2.content_hash, "license": "recorded-1.0"}
    (tmp_path / "draftsmith_source.json").write_text(json.dumps(record))
    assert converted_license(source, tmp_path, smollm2.content_hash) == "recorded-1.0"  # read from the record
    (tmp_path / "draftsmith_source.json").write_text(json.dumps({**record, "sha256": "0" * 64}))
    assert converted_license(source, tmp_path, smollm2.content_hash) == "apache-2.0"  # another file's: not trusted


def test_a_target_given_by_a_relative_path_is_recorded_absolute(tiny_target_dir, monkeypatch):
    """A draft records the target it was loaded by: a relative path would not be found by a
    later stage run from another folder."""
    from trainer.target import load_target

    monkeypatch.chdir(tiny_target_dir.parent)
    t = load_target(tiny_target_dir.name)
    assert t.spec == str(tiny_target_dir.resolve()) and t.path == str(tiny_target_dir.resolve())


def test_a_gguf_is_parsed_once_within_a_conversion_and_anew_after_it(tmp_path):
    """gguf_to_hf_dir's loaders (transformers' tokenizer, model and config, and the license read) share
    one parse of the file within the conversion; after it (also when it fails), readers are gguf's own."""
    import gguf
    import numpy as np

    from trainer.target import _each_gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.license", "apache-2.0")
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with _each_gguf_parsed_once() as reader:
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first is reader(str(tmp_path / "." / "tiny.gguf"))
        assert str(first.fields["general.license"].contents()) == "apache-2.0"
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader and gguf.GGUFReader(str(path)) is not first
    with pytest.raises(ValueError), _each_gguf_parsed_once():
        raise ValueError("a failed conversion")
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader
