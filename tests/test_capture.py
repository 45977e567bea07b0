import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from recipes import capture, prepare
from tests.conftest import REPO, small_filesystem
from trainer import faults
from trainer.capture import capture_batch, right_pad, token_budget_batches
from trainer.config import CaptureConfig, PrepareConfig
from trainer.data.shards import CaptureReader, verify_capture
from trainer.errors import DraftsmithError


@pytest.fixture
def prepared(tmp_path, tiny_target_dir, good_chats_jsonl):
    out = tmp_path / "prepared"
    prepare.run(PrepareConfig(output_dir=str(out), target=str(tiny_target_dir), source=str(good_chats_jsonl),
                              max_length=256))
    return out


def _cfg(prepared, out, target_dir, **kw):
    kw = {"samples_per_shard": 4, "max_tokens_per_batch": 96, "draft_vocab_size": 64, **kw}
    return CaptureConfig(data=str(prepared), output_dir=str(out), target=str(target_dir), **kw)


def _shard_hashes(out):
    return {e["file"]: e["sha256"] for e in json.loads((out / "manifest.json").read_text())["shards"]}


def test_shards_hold_the_targets_states(tmp_path, prepared, tiny_target_dir, tiny_target):
    m = capture.run(_cfg(prepared, tmp_path / "cap", tiny_target_dir, store_dtype="float32"))
    assert m["samples"] == 12 and len(m["shards"]) == 3
    # vLLM's (2, L//2, L-3) = [2, 2, 1] is not servable for L=4
    assert m["aux_layer_ids"] == [1, 2, 3] and m["draft_layer_ids"] == {"eagle3": [1, 2, 3]}
    assert m["layer_id_convention"] == "entering-layer"
    reader = CaptureReader(tmp_path / "cap")
    assert len(reader) == 12
    H = tiny_target.hidden_size
    for i in (0, 5, 11):
        s = reader[i]
        out = tiny_target.forward(s["input_ids"].long()[None], aux_layer_ids=[1, 2, 3])
        torch.testing.assert_close(s["aux_hidden_states"], out.aux_hidden_states[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s["last_hidden_state"], out.last_hidden_state[0], atol=1e-5, rtol=1e-4)
        assert s["aux_hidden_states"].shape == (len(s["input_ids"]), 3 * H)
        # the captured pre-norm state recomputes the target's logits
        torch.testing.assert_close(tiny_target.logits_from_last_hidden(s["last_hidden_state"]), out.logits[0],
                                   atol=1e-4, rtol=1e-4)
    verify_capture(tmp_path / "cap")
    assert m["bytes_per_token"]["on_disk"] == pytest.approx(m["bytes_per_token"]["expected"], rel=0.02)


def test_draft_vocab_is_the_most_frequent_assistant_tokens(tmp_path, prepared, tiny_target_dir):
    capture.run(_cfg(prepared, tmp_path / "cap", tiny_target_dir, draft_vocab_size=16))
    v = load_file(tmp_path / "cap" / "draft_vocab.safetensors")
    d2t, t2d, counts = v["d2t"], v["t2d"], v["counts"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and d2t.numel() == 16 and int(t2d.sum()) == 16
    target_ids = torch.arange(16) + d2t  # target_id = draft_id + d2t[draft_id]
    assert torch.equal(target_ids, torch.nonzero(t2d).flatten())
    assert int(counts[target_ids].min()) >= int(counts[~t2d].max())  # nothing left out is more frequent


def test_online_states_equal_the_shards(tmp_path, prepared, tiny_target_dir, tiny_target):
    capture.run(_cfg(prepared, tmp_path / "cap", tiny_target_dir))
    reader = CaptureReader(tmp_path / "cap")
    seqs = [reader[i]["input_ids"].tolist() for i in range(4)]
    ids, mask = right_pad(seqs, 0)
    online = capture_batch(tiny_target, ids, mask, [1, 2, 3], torch.bfloat16)
    for r in range(4):
        T = len(seqs[r])
        torch.testing.assert_close(online["aux_hidden_states"][r, :T], reader[r]["aux_hidden_states"],
                                   atol=1e-2, rtol=1e-2)
    # the greedy token stored with the states is the target's own argmax over its full logits
    logits = tiny_target.forward(ids, mask).logits
    for r in range(4):
        T = len(seqs[r])
        assert torch.equal(reader[r]["target_argmax"].long(), logits[r, :T].argmax(-1))
        assert torch.equal(online["target_argmax"][r, :T].long(), logits[r, :T].argmax(-1))


def test_token_budget_batches_cover_every_sample_once():
    lengths = [5, 40, 7, 40, 3, 100, 8]
    batches = token_budget_batches(lengths, 80)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 80 for b in batches)
    assert batches == token_budget_batches(lengths, 80)


def test_refuses_data_prepared_for_another_target(tmp_path, prepared):
    from tests.conftest import make_tiny_model, make_tiny_tokenizer

    other = tmp_path / "other"
    tok = make_tiny_tokenizer()
    make_tiny_model(len(tok), seed=1).save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(DraftsmithError, match="was prepared with target .* re-run prepare with this target"):
        capture.run(_cfg(prepared, tmp_path / "cap", other))


def test_existing_output_rules(tmp_path, prepared, tiny_target_dir):
    (tmp_path / "junk").mkdir()
    with pytest.raises(DraftsmithError, match="exists and is not a capture"):
        capture.run(_cfg(prepared, tmp_path / "junk", tiny_target_dir))
    capture.run(_cfg(prepared, tmp_path / "cap", tiny_target_dir))
    again = capture.run(_cfg(prepared, tmp_path / "cap", tiny_target_dir))
    assert again["run"]["already_complete"]
    with pytest.raises(DraftsmithError, match=r"made with other settings \(aux_layer_ids, draft_layer_ids\)"):
        capture.run(_cfg(prepared, tmp_path / "cap", tiny_target_dir, aux_layer_ids=[1, 3]))


def _run_capture(args, env_extra=None, launcher=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = (launcher or [sys.executable]) + [str(REPO / "recipes" / "capture.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def test_killed_capture_resumes_to_identical_shards(tmp_path, prepared, tiny_target_dir):
    args = [f"data={prepared}", f"target={tiny_target_dir}", "samples_per_shard=4", "max_tokens_per_batch=96",
            "draft_vocab_size=64"]
    ref = _run_capture([*args, f"output_dir={tmp_path}/ref"])
    assert ref.returncode == 0, ref.stderr
    # Kill mid-shard: 12 samples of ~25-60 tokens in batches of <=96 padded tokens -> several batches a shard.
    killed = _run_capture([*args, f"output_dir={tmp_path}/cut"], {faults.CAPTURE_AFTER_BATCHES: "4"})
    assert killed.returncode == faults.EXIT_CODE, killed.stderr
    assert not (tmp_path / "cut" / "manifest.json").exists()
    done_before = sorted(p.name for p in (tmp_path / "cut").glob("shard-*.json"))
    assert 0 < len(done_before) < 3, done_before  # killed with some, not all, shards complete
    resumed = _run_capture([*args, f"output_dir={tmp_path}/cut"])
    assert resumed.returncode == 0, resumed.stderr
    assert _shard_hashes(tmp_path / "cut") == _shard_hashes(tmp_path / "ref")
    a = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    b = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert a == b


def test_data_parallel_capture_under_accelerate_launch(tmp_path, prepared, tiny_target_dir):
    args = [f"data={prepared}", f"target={tiny_target_dir}", "samples_per_shard=4", "max_tokens_per_batch=96",
            "draft_vocab_size=64"]
    single = _run_capture([*args, f"output_dir={tmp_path}/one"])
    assert single.returncode == 0, single.stderr
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    two = _run_capture([*args, f"output_dir={tmp_path}/two"], {"ACCELERATE_USE_CPU": "true"}, launcher=accelerate)
    assert two.returncode == 0, two.stderr
    prov = json.loads((tmp_path / "two" / "provenance.json").read_text())
    assert prov["world_size"] == 2  # `--cpu --num_processes 2` would silently run one process
    assert _shard_hashes(tmp_path / "two") == _shard_hashes(tmp_path / "one")


def test_float8_rows_round_to_e4m3_with_their_own_scale():
    """store_states float8_e4m3: each token's state of each layer is scaled by its own max |x| / 448
    (so rows of very different magnitude keep e4m3's precision) and dequantize inverts it within
    e4m3's rounding: 2^-4 relative for normal values, scale x 2^-9 absolute near zero."""
    from trainer.data.shards import dequantize, store_states

    torch.manual_seed(0)
    H = 16
    aux = torch.randn(6, 3 * H) * torch.tensor([1.0, 300.0, 1e-3]).repeat_interleave(H)  # 3 layers, 3 magnitudes
    last = torch.randn(6, H) * 50
    s = store_states(aux, last, "float8_e4m3")
    assert s["aux_hidden_states"].dtype == torch.float8_e4m3fn and s["aux_scales"].shape == (6, 3)
    assert s["last_scales"].shape == (6, 1)
    for x, q, scale in ((aux, s["aux_hidden_states"], s["aux_scales"]),
                        (last, s["last_hidden_state"], s["last_scales"])):
        back = dequantize(q, scale, torch.float32)
        bound = torch.maximum(x.abs() * 2**-4, scale.repeat_interleave(H, -1) * 2**-9)
        assert ((back - x).abs() <= bound).all()
        assert q.float().abs().unflatten(-1, (-1, H)).amax(-1).eq(448).all()  # every row uses e4m3's whole range
    assert s["aux_scales"][:, 1].mean() > 1e5 * s["aux_scales"][:, 2].mean()  # a scale per layer, not per row
    b = store_states(aux, last, "bfloat16")
    assert b.keys() == {"aux_hidden_states", "last_hidden_state"} and b["aux_hidden_states"].dtype == torch.bfloat16


def test_states_a_store_dtype_cannot_hold_are_refused_not_stored_as_inf():
    """float16 tops out at 65504: finite states above it (massive activations) would be stored as
    inf after the finite check. What is checked is what is stored: float16 refuses them naming the
    sample, token and layer; padding is not checked; bfloat16, float32 and float8 hold them."""
    from trainer.data.shards import store_states
    from trainer.errors import DataError

    with pytest.raises(DataError, match=r"stored aux layer 0 of 2 at token 0 does not fit store_dtype=float16"):
        store_states(torch.full((1, 3, 8), 7e4), torch.ones(1, 3, 4), "float16")  # the case
    aux, last = torch.ones(2, 3, 2 * 8), torch.ones(2, 3, 8)
    aux[1, 2, 8 + 3] = -7e4  # row 1, token 2, aux layer 1
    with pytest.raises(DataError, match=r"^sample b: stored aux layer 1 of 2 at token 2 .*\|x\| up to 7e\+04"):
        store_states(aux, last, "float16", samples=["a", "b"], lengths=[3, 3])
    assert store_states(aux, last, "float16", samples=["a", "b"], lengths=[3, 2])  # token 2 of b is padding
    last[0, 1, 5] = 1e5
    with pytest.raises(DataError, match=r"^sample a: the last layer's state at token 1 "):
        store_states(aux, last, "float16", samples=["a", "b"], lengths=[3, 3])
    for dtype in ("bfloat16", "float32", "float8_e4m3"):
        stored = store_states(aux, last, dtype, samples=["a", "b"], lengths=[3, 3])
        assert all(torch.isfinite(v.float()).all() for v in stored.values())


def test_a_float8_capture_halves_bfloat16_and_trains_on_its_dequantized_states(tmp_path, prepared, tiny_target_dir,
                                                                             tiny_target):
    """store_dtype=float8_e4m3: bytes/token on disk are the expected ones (half of bfloat16's
    states plus a float32 scale per state); a draft's subset of layers keeps its own scales; the
    collate path dequantizes on the device to the full-precision states within e4m3 rounding;
    training reads it."""
    from recipes import train
    from trainer.config import TrainConfig, load_config
    from trainer.data.collate import CapturedSamples, collate, dequantize_states
    from trainer.data.shards import bytes_per_token

    ms = {d: capture.run(_cfg(prepared, tmp_path / d, tiny_target_dir, store_dtype=d))
          for d in ("float32", "bfloat16", "float8_e4m3")}
    H = tiny_target.hidden_size
    assert ms["float8_e4m3"]["bytes_per_token"]["expected"] == bytes_per_token(3, H, "float8_e4m3") == 4 * H + 4 * 4 + 9
    for m in ms.values():  # the manifest's expected figure is what is on disk (the safetensors header aside)
        assert m["bytes_per_token"]["on_disk"] == pytest.approx(m["bytes_per_token"]["expected"], rel=0.05)
    assert ms["float8_e4m3"]["bytes_per_token"]["on_disk"] < 0.6 * ms["bfloat16"]["bytes_per_token"]["on_disk"]
    verify_capture(tmp_path / "float8_e4m3")
    full = CapturedSamples(tmp_path / "float32", 256, [1, 3])
    fp8 = CapturedSamples(tmp_path / "float8_e4m3", 256, [1, 3])  # a subset: the scales follow their layers
    batch = dequantize_states(collate([fp8[i] for i in range(3)]), torch.float32)
    ref = collate([full[i] for i in range(3)])
    assert "aux_scales" not in batch and batch["aux_hidden_states"].shape == ref["aux_hidden_states"].shape
    for name in ("aux_hidden_states", "last_hidden_state"):
        err = (batch[name] - ref[name]).abs()
        assert (err <= ref[name].abs() * 2**-4 + ref[name].abs().amax(-1, keepdim=True) * 2**-8).all(), name
    assert torch.equal(batch["target_argmax"], ref["target_argmax"])
    r = train.run(load_config(TrainConfig, REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml", [
        f"data={tmp_path / 'float8_e4m3'}", f"target={tiny_target_dir}", f"output_dir={tmp_path / 'd'}",
        "max_steps=2", "log_every=1"]))
    r32 = train.run(load_config(TrainConfig, REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml", [
        f"data={tmp_path / 'float32'}", f"target={tiny_target_dir}", f"output_dir={tmp_path / 'd32'}",
        "max_steps=2", "log_every=1"]))
    # the same batch, about the same loss
    assert r["history"][0]["loss"] == pytest.approx(r32["history"][0]["loss"], rel=0.05)


def test_estimate_before_anything_runs_and_a_capture_that_cannot_fit_is_refused(tmp_path, prepared, tiny_target_dir,
                                                                              capsys):
    """capture estimate=true prints bytes/token, the disk it needs and whether it fits, and writes
    nothing; a capture into a filesystem without the room is one line (needed vs free), before any work."""
    from tests.test_bad_input import one_line_error
    from trainer.data.shards import bytes_per_token

    argv = [f"data={prepared}", f"target={tiny_target_dir}", "draft_vocab_size=64"]
    capture.main([*argv, f"output_dir={tmp_path / 'e'}", "estimate=true", "store_dtype=float8_e4m3"])
    out = capsys.readouterr().out
    bpt = bytes_per_token(3, 64, "float8_e4m3")
    assert f"bytes/token {bpt:,.1f}" in out and "fits" in out and "time:" in out, out
    assert not (tmp_path / "e").exists()
    with small_filesystem(tmp_path / "small", "64k") as small:
        capture.main([*argv, f"output_dir={small / 'cap'}", "estimate=true", "store_dtype=float32"])
        assert "DOES NOT FIT" in capsys.readouterr().out
        one_line_error(capsys, capture.main, [*argv, f"output_dir={small / 'cap'}", "store_dtype=float32"],
                       "KiB free", "needs")
        assert not (small / "cap").exists()
