"""The EAGLE-3 training recipe on a tiny target: loss falls, resume is exact,
accumulation is equivalent to a larger batch, DDP and DeepSpeed ZeRO-2 on 2 CPU processes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from recipes import train
from tests.conftest import REPO
from trainer import faults
from trainer.config import TrainConfig, load_config
from trainer.errors import DraftsmithError

TINY = REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml"


def _args(tiny_capture, target_dir, out, *extra):
    return ["--config", str(TINY), f"data={tiny_capture}", f"target={target_dir}", f"output_dir={out}", *extra]


def _cfg(tiny_capture, target_dir, out, *extra):
    return load_config(TrainConfig, TINY, _args(tiny_capture, target_dir, out, *extra)[2:])


def test_loss_falls_and_tau_rises(tmp_path, tiny_capture, tiny_target_dir):
    r = train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "o", "max_steps=80", "epochs=80", "log_every=10"))
    first, last = r["history"][0], r["history"][-1]
    assert last["loss"] < 0.85 * first["loss"], (first["loss"], last["loss"])
    assert last["tau"] > first["tau"]
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["draft"]["aux_layer_ids"] == [2, 2, 1] and cfg["draft"]["draft_vocab_size"] == 64
    w = load_file(tmp_path / "o" / "model.safetensors")
    assert "embed_tokens.weight" not in w and w["fc.weight"].shape == (64, 3 * 64)
    assert {"d2t", "t2d", "lm_head.weight", "midlayer.self_attn.q_proj.weight"} <= set(w)
    for name in ("config.yaml", "command.txt", "provenance.json", "train_report.json"):
        assert (tmp_path / "o" / name).is_file()


def test_batch_of_8_equals_8_accumulated_batches_of_1(tmp_path, tiny_capture, tiny_target_dir):
    a = tmp_path / "a"
    b = tmp_path / "b"
    train.run(_cfg(tiny_capture, tiny_target_dir, a, "max_steps=1", "batch_size=8", "gradient_accumulation_steps=1"))
    train.run(_cfg(tiny_capture, tiny_target_dir, b, "max_steps=1", "batch_size=1", "gradient_accumulation_steps=8"))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-6, rtol=1e-5, msg=k)


def test_gradient_checkpointing_changes_memory_not_results(tmp_path, tiny_capture, tiny_target_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    train.run(_cfg(tiny_capture, tiny_target_dir, a, "max_steps=2"))
    train.run(_cfg(tiny_capture, tiny_target_dir, b, "max_steps=2", "gradient_checkpointing=true"))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5, msg=k)


def _launch(args, env=None, launcher=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = (launcher or [sys.executable]) + [str(REPO / "recipes" / "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


def test_killed_training_resumes_bit_identical(tmp_path, tiny_capture, tiny_target_dir):
    common = ["max_steps=10", "epochs=10", "save_every=4"]
    ref = _launch(_args(tiny_capture, tiny_target_dir, tmp_path / "ref", *common))
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = _launch(_args(tiny_capture, tiny_target_dir, tmp_path / "cut", *common),
                     {faults.TRAIN_AFTER_STEPS: "6"})  # dies at step 6; the last checkpoint is step 4
    assert killed.returncode == faults.EXIT_CODE, killed.stderr[-2000:]
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    resumed = _launch(_args(tiny_capture, tiny_target_dir, tmp_path / "cut", *common, "resume=latest"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    wa, wb = load_file(tmp_path / "ref" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]


def test_ddp_on_two_cpu_processes(tmp_path, tiny_capture, tiny_target_dir):
    r = _launch(_args(tiny_capture, tiny_target_dir, tmp_path / "ddp", "max_steps=6", "epochs=10"),
                {"ACCELERATE_USE_CPU": "true"}, [*ACCELERATE[:3], "--multi_gpu", *ACCELERATE[3:]])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "ddp" / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 6
    assert all(torch.isfinite(v).all() for v in load_file(tmp_path / "ddp" / "model.safetensors").values()
               if v.is_floating_point())


def test_deepspeed_zero2_on_two_cpu_processes(tmp_path, tiny_capture, tiny_target_dir):
    pytest.importorskip("deepspeed")
    # Not ACCELERATE_USE_CPU: it makes accelerate bypass DeepSpeed. DeepSpeed picks its CPU
    # accelerator itself; its shared-memory op compiles once into the cache below.
    env = {"TORCH_EXTENSIONS_DIR": str(torch_extensions_dir())}
    r = _launch(_args(tiny_capture, tiny_target_dir, tmp_path / "z2", "max_steps=3", "epochs=10"), env,
                [*ACCELERATE[:3], "--config_file", str(REPO / "recipes" / "accelerate" / "zero2.yaml"), *ACCELERATE[3:]])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "z2" / "train_report.json").read_text())
    assert report["distributed_type"] == "DistributedType.DEEPSPEED" and report["world_size"] == 2
    assert report["steps"] == 3 and report["final"]["loss"] > 0


def torch_extensions_dir():
    from trainer.target import cache_root

    return cache_root() / "torch_extensions"


def test_refuses_a_capture_of_another_target(tmp_path, tiny_capture):
    from tests.conftest import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    make_tiny_model(len(tok), seed=3).save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.raises(DraftsmithError, match=r"was made from .* sha256"):
        train.run(_cfg(tiny_capture, tmp_path / "other", tmp_path / "o"))


def test_refuses_draft_layer_ids_that_disagree_with_the_capture(tmp_path, tiny_capture, tiny_target_dir):
    with pytest.raises(DraftsmithError, match=r"draft.aux_layer_ids \[1, 2, 3\] != the capture's \[2, 2, 1\]"):
        train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "o", "draft.aux_layer_ids=[1,2,3]"))


def test_online_mode_trains_from_the_target_in_the_loop(tmp_path, tiny_capture, tiny_target_dir):
    prepared = tiny_capture.parent / "prepared"
    r = train.run(_cfg(prepared, tiny_target_dir, tmp_path / "on", "online=true", "max_steps=4"))
    assert r["steps"] == 4 and r["final"]["loss"] > 0
