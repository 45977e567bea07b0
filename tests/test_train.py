"""The training recipe on a tiny target: loss falls, resume is exact, accumulation is
equivalent to a larger batch, and several processes equal one: 2 x batch 1 under DDP ==
1 x batch 2, and DeepSpeed ZeRO-2 == DDP (same per-step loss and LR, weights within 2e-5)."""

import dataclasses
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
    assert cfg["draft"]["aux_layer_ids"] == [1, 2, 3] and cfg["draft"]["draft_vocab_size"] == 64
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


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_gradient_checkpointing_changes_memory_not_results(tmp_path, tiny_capture, tiny_target_dir, algorithm):
    """Through the recipe (accelerate's prepared model): the same losses and weights with the
    draft's layers recomputed in backward, for every algorithm."""
    config = REPO / "recipes" / "configs" / "tiny" / f"{algorithm}.yaml"
    runs = {}
    for name, extra in (("a", []), ("b", ["gradient_checkpointing=true"])):
        runs[name] = train.run(load_config(TrainConfig, config, [
            f"data={tiny_capture}", f"target={tiny_target_dir}", f"output_dir={tmp_path / name}", "max_steps=2",
            "log_every=1", *extra]))
    assert [h["loss"] for h in runs["a"]["history"]] == pytest.approx([h["loss"] for h in runs["b"]["history"]],
                                                                       rel=1e-6)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5, msg=k)


def test_draft_vocab_size_has_one_meaning(tmp_path, tiny_capture, tiny_target_dir, capsys):
    """null: the capture's vocabulary for EAGLE-3 (64 here), the target's full head for a block
    draft; a smaller int: that many tokens (the most frequent); larger than the capture's: one line
    naming both sizes, before any training."""
    smaller = train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "e32", "max_steps=1",
                             "draft.draft_vocab_size=32"))
    cfg = json.loads((tmp_path / "e32" / "config.json").read_text())["draft"]
    w = load_file(tmp_path / "e32" / "model.safetensors")
    assert smaller["history"] and cfg["draft_vocab_size"] == 32 and w["lm_head.weight"].shape[0] == 32
    counts = load_file(tiny_capture / "draft_vocab.safetensors")["counts"]
    assert sorted((w["d2t"] + torch.arange(32)).tolist()) == sorted(counts.argsort(descending=True, stable=True)[:32]
                                                                     .tolist())  # the 32 most frequent
    dflash = REPO / "recipes" / "configs" / "tiny" / "dflash.yaml"
    train.run(load_config(TrainConfig, dflash, [f"data={tiny_capture}", f"target={tiny_target_dir}",
                                                f"output_dir={tmp_path / 'd'}", "max_steps=1"]))
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft"]["draft_vocab_size"] is None
    assert "lm_head.weight" not in load_file(tmp_path / "d" / "model.safetensors")  # the target's full head
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(_args(tiny_capture, tiny_target_dir, tmp_path / "e128", "draft.draft_vocab_size=128"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "128" in err[0] and "(64 tokens)" in err[0], err
    assert not (tmp_path / "e128").exists()


def _launch(args, env=None, launcher=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = (launcher or [sys.executable]) + [str(REPO / "recipes" / "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


@pytest.mark.parametrize("extra", [[], ["optimizer=muon", "lr_schedule=wsd", "draft.loss=lk_hybrid"]],
                         ids=["adamw-cosine", "muon-wsd-lk_hybrid"])
def test_killed_training_resumes_bit_identical(tmp_path, tiny_capture, tiny_target_dir, extra):
    """Every optimizer and schedule: Muon's momentum and AdamW's moments, both schedules' steps,
    are in the checkpoint, so a killed run resumed ends with the weights of an uninterrupted one."""
    common = ["max_steps=10", "epochs=10", "save_every=4", *extra]
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


def test_a_non_finite_loss_stops_before_a_weight_or_a_checkpoint_takes_it(tmp_path, tiny_capture, tiny_target_dir,
                                                                          monkeypatch):
    """Checked at every optimizer update, not at log steps (issue 40): with a checkpoint every 5
    steps, a log line every 10 and one checkpoint kept, a NaN loss at step 3 once wrote checkpoint_1
    of NaN weights (keep_last rotated the finite ones away) and stopped only at step 10. Now the run
    stops at the update whose loss is NaN, before the optimizer applies it: no checkpoint holds
    non-finite weights, and resume=latest from the last finite one finishes the run."""
    common = ["max_steps=12", "epochs=12", "log_every=10", "save_every=5", "keep_last=1"]
    monkeypatch.setenv(faults.TRAIN_NAN_LOSS_AT_STEP, "3")
    with pytest.raises(DraftsmithError, match=r"^step 3: the loss is nan.*no checkpoint was written yet"):
        train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "a", *common))
    assert not (tmp_path / "a").exists()  # nothing to resume: nothing left behind
    monkeypatch.setenv(faults.TRAIN_NAN_LOSS_AT_STEP, "7")
    with pytest.raises(DraftsmithError, match=r"^step 7: .*\(checkpoint_1\) holds finite weights: resume=latest"):
        train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "b", *common))
    kept = train.complete_checkpoints(tmp_path / "b")
    assert [c.name for c in kept] == ["checkpoint_1"]
    assert all(torch.isfinite(w).all() for w in load_file(kept[0] / "model.safetensors").values())
    monkeypatch.delenv(faults.TRAIN_NAN_LOSS_AT_STEP)
    r = train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "b", *common, "resume=latest"))
    assert r["steps"] == 12
    assert all(torch.isfinite(w).all() for w in load_file(tmp_path / "b" / "model.safetensors").values())


def test_muon_takes_the_matrices_and_wsd_holds_the_rate_until_its_decay(tmp_path, tiny_capture, tiny_target_dir):
    """optimizer=muon: torch's Muon on the draft layers' 2-D matrices, AdamW on norms and the
    vocabulary head (trainer/optim.py); lr_schedule=wsd: warmup, the peak rate held, then linear
    to 0 over the last decay_fraction of the steps; what was used is in the run's report."""
    from trainer.optim import build_optimizers, build_schedule

    cfg = _cfg(tiny_capture, tiny_target_dir, tmp_path / "o", "optimizer=muon", "lr_schedule=wsd",
               "warmup_steps=2", "decay_fraction=0.25", "max_steps=12", "learning_rate=0.001", "muon_lr=0.01")
    named = [("draft.fc.weight", torch.nn.Parameter(torch.ones(4, 12))),
             ("draft.lm_head.weight", torch.nn.Parameter(torch.ones(20, 4))),
             ("draft.norm.weight", torch.nn.Parameter(torch.ones(4)))]
    muon, adamw = build_optimizers(named, cfg)
    assert isinstance(muon, torch.optim.Muon) and [p.shape for p in muon.param_groups[0]["params"]] == [(4, 12)]
    assert isinstance(adamw, torch.optim.AdamW) and len(adamw.param_groups[0]["params"]) == 2
    assert muon.param_groups[0]["lr"] == 0.01 and adamw.param_groups[0]["lr"] == 0.001
    sched = build_schedule(adamw, cfg, 12)
    lrs = []
    for _ in range(12):
        lrs.append(sched.get_last_lr()[0])
        adamw.step()
        sched.step()
    assert lrs[:2] == [0.0, 0.0005] and lrs[2:9] == [0.001] * 7  # warmup, then held
    assert lrs[9:] == sorted(lrs[9:], reverse=True) and lrs[-1] < 0.001 / 2  # the last quarter decays
    r = train.run(cfg)
    assert r["history"][-1]["lr"] == 0.0


def test_muon_in_float32_is_torchs_algorithm_and_auto_takes_it_on_a_cpu_without_bf16_matmul(
        tmp_path, tiny_capture, tiny_target_dir, capsys, monkeypatch):
    """trainer.optim.muon_update run in bfloat16 is torch's Muon step bit for bit (wide and tall
    matrices, Nesterov or not, both learning-rate adjustments, weight decay, three steps); in float32
    its Newton-Schulz is the float64 iteration's to float32 rounding. muon_ns_dtype=auto takes float32
    on a CPU whose capability has no bf16 matmul (AVX2), says so in one line, and records it; on an
    AVX-512 CPU or a GPU it is torch's bfloat16; forcing bfloat16 on AVX2 is said to be slow."""
    from trainer.optim import NS_COEFFICIENTS, Muon, muon_ns_dtype, muon_update, newton_schulz

    for shape, nesterov, adjust in (((6, 10), True, "match_rms_adamw"), ((12, 5), False, "original")):
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(*shape, generator=gen)
        grads = [torch.randn(*shape, generator=gen) for _ in range(3)]
        kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
        ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        mine, torchs = Muon([ours], **kw), torch.optim.Muon([theirs], **kw)
        f32 = torch.nn.Parameter(w.clone())
        in_f32 = Muon([f32], ns_dtype=torch.float32, **kw)
        buf = torch.zeros_like(w)
        for g in grads:
            f32.grad = g.clone()
            in_f32.step()
            with torch.no_grad():  # the hand-written step in bfloat16, beside torch's own
                muon_update(ours, g.clone(), buf, mine.param_groups[0], torch.bfloat16)
            theirs.grad = g.clone()
            torchs.step()
            assert torch.equal(ours.data, theirs.data), (shape, nesterov, adjust)
        assert torch.equal(buf, torchs.state[theirs]["momentum_buffer"])
        moved = (theirs.data - w).norm()  # float32's step is torch's to its bfloat16 rounding (~1%)
        assert (f32.data - theirs.data).norm() / moved < 0.03 and not torch.equal(f32.data, theirs.data)
        assert torch.equal(in_f32.state[f32]["momentum_buffer"], buf)
        g = grads[0]
        exact = newton_schulz(g.double(), NS_COEFFICIENTS, 5, 1e-7, torch.float64)
        assert torch.allclose(newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, torch.float32).double(), exact, atol=1e-5)
    from trainer import optim

    for capability, flags, dtype in (("AVX2", None, torch.float32), ("NO AVX", None, torch.float32),
                                     ("AVX512", None, torch.bfloat16), ("AVX2", {"avx2", "fma"}, torch.float32),
                                     ("AVX512", {"avx512f"}, torch.float32),  # AVX-512 without its BF16
                                     ("AVX512", {"avx512f", "avx512_bf16"}, torch.bfloat16),
                                     ("DEFAULT", {"asimd", "bf16"}, torch.bfloat16)):  # arm64
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(optim, "cpu_flags", lambda f=flags: f)
        got, line = muon_ns_dtype("auto", torch.device("cpu"))
        assert got == dtype and (line is None) == (dtype == torch.bfloat16), (capability, flags)
        assert dtype == torch.bfloat16 or "orthogonalizes in float32" in line
        assert muon_ns_dtype("auto", torch.device("cuda", 0)) == (torch.bfloat16, None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(optim, "cpu_flags", lambda: {"avx2"})
    assert "muon_ns_dtype=auto" in muon_ns_dtype("bfloat16", torch.device("cpu"))[1]
    for optimizer, said in (("muon", True), ("adamw", False)):
        r = train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / optimizer, f"optimizer={optimizer}",
                           "max_steps=1"))
        lines = [line for line in capsys.readouterr().out.splitlines() if "no bfloat16 matmul" in line]
        assert len(lines) == int(said) and r.get("muon_ns_dtype") == ("float32" if said else None), lines


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
# 4 optimizer updates of effective batch 8 (16 samples: 2 epochs), a warmup and a cosine decay,
# a log line per update: per-step loss and LR can be compared across launch modes.
EQUIV = ["max_steps=4", "epochs=10", "log_every=1", "gradient_accumulation_steps=4", "warmup_steps=2",
         "save_every=1000"]
WEIGHTS_TOL = dict(atol=2e-5, rtol=1e-4)  # fp32; reductions run in another order across processes


def _ddp(args):
    return _launch(args, {"ACCELERATE_USE_CPU": "true"}, [*ACCELERATE[:3], "--multi_gpu", *ACCELERATE[3:]])


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_capture, tiny_target_dir):
    """2 processes x batch 1 x accumulation 4 under DDP on the CPU."""
    out = tmp_path_factory.mktemp("ddp") / "o"
    r = _ddp(_args(tiny_capture, tiny_target_dir, out, "batch_size=1", *EQUIV))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _same_run(a, b):
    ra, rb = (json.loads((d / "train_report.json").read_text()) for d in (a, b))
    assert ra["steps"] == rb["steps"] == 4
    assert ra["effective"]["effective_batch"] == rb["effective"]["effective_batch"] == 8
    assert [h["step"] for h in ra["history"]] == [h["step"] for h in rb["history"]] == [1, 2, 3, 4]
    lr_a, lr_b = [h["lr"] for h in ra["history"]], [h["lr"] for h in rb["history"]]
    assert lr_a == pytest.approx(lr_b, rel=1e-9)
    assert lr_a[-1] == pytest.approx(0.0, abs=1e-12) and max(lr_a) == pytest.approx(0.003)  # one cosine, ended
    assert [h["loss"] for h in ra["history"]] == pytest.approx([h["loss"] for h in rb["history"]], rel=1e-5)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **WEIGHTS_TOL, msg=k)
    return ra, rb


def test_ddp_two_processes_equal_one_process_with_twice_the_batch(tmp_path, ddp_run, tiny_capture, tiny_target_dir):
    single = tmp_path / "single"
    train.run(_cfg(tiny_capture, tiny_target_dir, single, "batch_size=2", *EQUIV))
    rs, rd = _same_run(single, ddp_run)
    assert (rs["world_size"], rd["world_size"]) == (1, 2)
    # the weights moved: an equivalence of two untrained drafts would prove nothing
    w0 = load_file(single / "model.safetensors")["fc.weight"]
    assert rs["history"][0]["loss"] != rs["history"][-1]["loss"] and torch.isfinite(w0).all()


def test_deepspeed_zero2_equals_ddp(tmp_path, ddp_run, tiny_capture, tiny_target_dir):
    import deepspeed  # noqa: F401  (CI must have it: fail, never skip)

    # Not ACCELERATE_USE_CPU: it makes accelerate bypass DeepSpeed. DeepSpeed picks its CPU
    # accelerator itself; its shared-memory op compiles once into the cache below.
    env = {"TORCH_EXTENSIONS_DIR": str(torch_extensions_dir())}
    r = _launch(_args(tiny_capture, tiny_target_dir, tmp_path / "z2", "batch_size=1", *EQUIV), env,
                [*ACCELERATE[:3], "--config_file", str(REPO / "recipes" / "accelerate" / "zero2.yaml"),
                 *ACCELERATE[3:]])
    assert r.returncode == 0, r.stderr[-3000:]
    rz, _ = _same_run(tmp_path / "z2", ddp_run)
    assert rz["distributed_type"] == "DistributedType.DEEPSPEED" and rz["world_size"] == 2
    # the engine's own accumulation, clipping and micro-batch are the recipe's
    assert rz["effective"] == {"gradient_accumulation_steps": 4, "batch_size": 1, "max_grad_norm": 0.5,
                               "world_size": 2, "effective_batch": 8}


def test_a_launch_file_that_overrides_the_recipe_is_refused(tmp_path, tiny_capture, tiny_target_dir, monkeypatch,
                                                             capsys):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    with pytest.raises(SystemExit) as e:
        train.main(_args(tiny_capture, tiny_target_dir, tmp_path / "o", "gradient_accumulation_steps=4"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the accelerate launch config sets ACCELERATE_GRADIENT_ACCUMULATION_STEPS=1 but the recipe "
                   "config has gradient_accumulation_steps=4; remove it from the launch file (the recipe config is "
                   "the one source) or set the recipe's value")
    assert not (tmp_path / "o").exists()


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


def test_refuses_draft_layer_ids_the_capture_does_not_hold(tmp_path, tiny_capture, tiny_target_dir):
    with pytest.raises(DraftsmithError, match=r"layer ids \[0\] are not in the capture \(it holds \[1, 2, 3\]\)"):
        train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "o", "draft.aux_layer_ids=[0,2]"))


@pytest.mark.parametrize("ids", ["[3,1,2]", "[1,1,2]", "[]"])
def test_layer_ids_must_be_strictly_increasing_at_load(tmp_path, tiny_capture, tiny_target_dir, ids):
    with pytest.raises(DraftsmithError, match=r"draft.aux_layer_ids .*(strictly increasing|empty)"):
        _cfg(tiny_capture, tiny_target_dir, tmp_path / "o", f"draft.aux_layer_ids={ids}")


def test_a_draft_trains_on_its_subset_of_the_captured_layers(tmp_path, tiny_capture, tiny_target_dir, tiny_target):
    """One capture serves drafts with different layers: the columns a draft selects by id are
    the target's states at those ids."""
    from trainer.data.collate import CapturedSamples

    sub = CapturedSamples(tiny_capture, 256, [1, 3])[5]
    out = tiny_target.forward(sub["input_ids"].long()[None], aux_layer_ids=[1, 3])
    torch.testing.assert_close(sub["aux_hidden_states"].float(), out.aux_hidden_states[0], atol=1e-5, rtol=1e-5)
    train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "o", "draft.aux_layer_ids=[1,3]", "max_steps=1"))
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["draft"]["aux_layer_ids"] == [1, 3]
    assert load_file(tmp_path / "o" / "model.safetensors")["fc.weight"].shape == (64, 2 * 64)


def test_online_training_equals_offline_training_on_an_fp32_capture(tmp_path, tiny_capture, tiny_target_dir):
    """Online (the target in the loop) and offline (an fp32 capture of the same samples) see the
    same states, vocabulary and order: the same run."""
    prepared = tiny_capture.parent / "prepared"
    common = ["max_steps=4", "log_every=1", "batch_size=2"]
    on = train.run(_cfg(prepared, tiny_target_dir, tmp_path / "on", "online.engine=hf", "online.draft_vocab_size=64",
                        *common))
    off = train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "off", *common))
    assert [h["loss"] for h in on["history"]] == pytest.approx([h["loss"] for h in off["history"]], rel=1e-5)
    won, woff = load_file(tmp_path / "on" / "model.safetensors"), load_file(tmp_path / "off" / "model.safetensors")
    assert torch.equal(won["d2t"], woff["d2t"])
    for k in won:
        torch.testing.assert_close(won[k], woff[k], atol=1e-5, rtol=1e-4, msg=k)


def test_collate_keeps_the_stored_dtype_until_the_device():
    """bf16 states stay bf16 in the batch (half the host memory and transfer); padding is zero
    and the values are the samples' own."""
    from trainer.data.collate import collate

    a = {"input_ids": torch.tensor([3, 4, 5]), "loss_mask": torch.tensor([0, 1, 1]),
         "aux_hidden_states": torch.randn(3, 6).bfloat16(), "last_hidden_state": torch.randn(3, 2).bfloat16()}
    b = {k: v[:2] for k, v in a.items()}
    batch = collate([a, b])
    for name in ("aux_hidden_states", "last_hidden_state"):
        assert batch[name].dtype == torch.bfloat16
        assert torch.equal(batch[name][0], a[name]) and torch.equal(batch[name][1, :2], b[name])
        assert not batch[name][1, 2:].any()
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_head_only_target_gives_the_full_targets_labels(tiny_capture, tiny_target_dir, tiny_target):
    """Offline training loads only the embedding, final norm and LM head; the labels it makes
    (EAGLE-3: the draft-vocabulary softmax from the head's draft rows) equal the full
    target's full-vocabulary logits restricted to the draft columns and softmaxed."""
    from trainer.data.collate import collate
    from trainer.data.shards import CaptureReader
    from trainer.drafts.registry import build, get
    from trainer.target import load_target

    head = load_target(str(tiny_target_dir), head_only=True)
    assert head.head_only and not tiny_target.head_only
    assert head.backbone.layers[0].self_attn.q_proj.weight.is_meta  # the decoder layers are never loaded
    for a, b in ((head.backbone.embed_tokens, tiny_target.backbone.embed_tokens),
                 (head.backbone.norm, tiny_target.backbone.norm), (head.model.lm_head, tiny_target.model.lm_head)):
        assert torch.equal(a.weight, b.weight)
    eagle3 = get("eagle3")
    reader = CaptureReader(tiny_capture)
    batch = collate([reader[0], reader[1]])
    cfg = eagle3.Config(ttt_steps=2).fill_from_target(head.model.config, reader.info.aux_layer_ids, 64)
    draft = build("eagle3", dataclasses.asdict(cfg), head)
    vocab = load_file(tiny_capture / "draft_vocab.safetensors")
    draft.set_vocab(vocab["d2t"], vocab["t2d"])
    labels = eagle3.target_labels(head, batch, draft)
    full = tiny_target.logits_from_last_hidden(batch["last_hidden_state"])  # [B, T, V]
    read = eagle3.shift_left(batch["loss_mask"], 1).bool()  # where training reads p: the next token is trained on
    assert read.any() and not read.all()
    torch.testing.assert_close(labels["p"][read], full[..., draft.draft_to_target()].softmax(-1)[read])
    assert not labels["p"][~read].any()  # never computed
    real = batch["attention_mask"].bool()
    assert torch.equal(labels["in_vocab"][real], draft.t2d[full.argmax(-1)][real])  # from the captured argmax
    with pytest.raises(Exception, match="head-only"):
        head.forward(batch["input_ids"])


def test_a_frozen_lm_head_is_the_targets_rows_and_stays(tmp_path, tiny_capture, tiny_target_dir, tiny_target):
    train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "f", "max_steps=3", "draft.train_lm_head=false"))
    w = load_file(tmp_path / "f" / "model.safetensors")
    rows = tiny_target.model.lm_head.weight[torch.arange(w["d2t"].numel()) + w["d2t"]]
    assert torch.equal(w["lm_head.weight"], rows)  # copied at the start, never updated
    train.run(_cfg(tiny_capture, tiny_target_dir, tmp_path / "t", "max_steps=3"))
    assert not torch.equal(load_file(tmp_path / "t" / "model.safetensors")["lm_head.weight"], rows)
