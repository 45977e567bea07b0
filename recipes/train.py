"""Train a draft (any registered algorithm: trainer.drafts.registry.DRAFTS) on a capture, or on the target in the loop.

    python recipes/train.py --config recipes/configs/smollm2-135m/eagle3.yaml
    accelerate launch recipes/train.py --config recipes/configs/smollm2-135m/eagle3.yaml
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/train.py --config ...

Reads top to bottom: config -> target -> data -> draft -> optimizer -> the loop ->
save. accelerate does processes, accumulation, clipping, checkpoint state and
trackers; the draft module owns its labels and training step (trainer/drafts/<algorithm>.py).

The recipe config is the one source of the batch, accumulation and clipping: a launch
file that sets them differently is refused, and after `prepare` the engine's effective
values are checked against the config. The LR schedule counts optimizer updates (it is
stepped once per update, whatever the number of processes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration, set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from recipes._common import one_line_errors, parse_args
from trainer import faults
from trainer.config import TrainConfig, to_yaml
from trainer.data.collate import CapturedSamples, PreparedSamples, collate, dequantize_states
from trainer.data.prepared import load_prepared
from trainer.data.shards import DRAFT_VOCAB, verify_capture
from trainer.data.vocab import build_draft_vocab, token_counts
from trainer.dist import check_world_size, flag
from trainer.drafts.folder import save_draft
from trainer.drafts.registry import VLLM_METHOD, TrainStep, build, get
from trainer.drafts.shape import DEFAULT_DRAFT_VOCAB_SIZE
from trainer.errors import DraftsmithError
from trainer.families import served_max_model_len
from trainer.io import (
    atomic_write_json,
    check_space,
    claim_output,
    ensure_dir,
    guard_output,
    sha256_file,
    write_run_files,
)
from trainer.metrics import simulated_tau
from trainer.online.run import open_online
from trainer.online.sources import StreamedSamples, epoch_plan
from trainer.optim import build_optimizers, build_schedule, muon_ns_dtype
from trainer.target import Target, load_target, resolve_target
from trainer.vllm.servable import check_servable


class Progress:
    """Loop position, saved with every checkpoint so that `resume=latest` restarts exactly."""

    def __init__(self):
        self.step, self.epoch, self.micro_in_epoch = 0, 0, 0

    def state_dict(self):
        return {"step": self.step, "epoch": self.epoch, "micro_in_epoch": self.micro_in_epoch}

    def load_state_dict(self, s):
        self.step, self.epoch, self.micro_in_epoch = s["step"], s["epoch"], s["micro_in_epoch"]


# What a launch file may set that the recipe config owns (accelerate's env beats code).
LAUNCH_OVERRIDES = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
                    "ACCELERATE_GRADIENT_CLIPPING": "max_grad_norm"}


def check_launch_env(cfg: TrainConfig) -> None:
    """One line if the accelerate launch config sets what the recipe config owns, differently."""
    for var, key in LAUNCH_OVERRIDES.items():
        value = os.environ.get(var)
        if value is None or value == "auto":
            continue
        if value.lower() in ("none", "false"):  # accelerate's "not set" for clipping
            continue
        if float(value) != float(getattr(cfg, key)):
            raise DraftsmithError(f"the accelerate launch config sets {var}={value} but the recipe config has "
                                  f"{key}={getattr(cfg, key)}; remove it from the launch file (the recipe config "
                                  "is the one source) or set the recipe's value")


def make_accelerator(cfg: TrainConfig, out: Path):
    check_launch_env(cfg)
    deepspeed = flag("ACCELERATE_USE_DEEPSPEED")
    on_cpu = flag("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    precision = ("bf16" if not on_cpu else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    plugin = None
    if deepspeed:  # stage, offload etc. from the launch file; accumulation and clipping from the recipe
        plugin = DeepSpeedPlugin(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                 gradient_clipping=cfg.max_grad_norm or None)
        plugin.deepspeed_config["gradient_clipping"] = float(cfg.max_grad_norm)  # 0 = off (not accelerate's 1.0)
    try:
        import tensorboard  # noqa: F401  (optional: the dev extra installs it; logs go nowhere without it)

        trackers = "tensorboard"
    except ImportError:
        trackers = None
    accelerator = Accelerator(
        # DeepSpeed picks its own accelerator (its CPU one here); accelerate's cpu=True would bypass it.
        cpu=on_cpu and not deepspeed, mixed_precision=precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        deepspeed_plugin=plugin,
        # The schedule counts optimizer updates: step it on sync_gradients ourselves. accelerate's
        # default steps it num_processes times per update (accelerate/scheduler.py), which ends a
        # cosine schedule halfway on 2 processes and climbs back.
        step_scheduler_with_optimizer=False,
        log_with=trackers,
        # checkpoints are named and published by save_checkpoint (staged, renamed when complete)
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # DeepSpeed and DDP on the CPU need the gloo backend (and a single process none).
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if on_cpu and expected > 1 else [],
    )
    check_world_size(accelerator.num_processes)
    return accelerator


def check_effective(cfg: TrainConfig, accelerator, model) -> dict:
    """The engine's effective accumulation, clipping and micro-batch must be the config's."""
    have = {"gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
            "batch_size": cfg.batch_size, "max_grad_norm": cfg.max_grad_norm}
    if hasattr(model, "gradient_accumulation_steps") and hasattr(model, "train_micro_batch_size_per_gpu"):
        have = {"gradient_accumulation_steps": model.gradient_accumulation_steps(),  # a DeepSpeed engine
                "batch_size": model.train_micro_batch_size_per_gpu(),
                "max_grad_norm": float(model.gradient_clipping() or 0.0)}
    wrong = [f"{k} {v} (config {getattr(cfg, k)})" for k, v in have.items() if float(v) != float(getattr(cfg, k))]
    if wrong:
        raise DraftsmithError(f"the launched engine trains with {', '.join(wrong)}; a launch or DeepSpeed config "
                              "overrides the recipe: remove those keys from it")
    return {**have, "world_size": accelerator.num_processes,
            "effective_batch": cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes}


def load_data(cfg: TrainConfig, target):
    """(dataset, the draft's aux layer ids, d2t, t2d, token counts, data description), validated against the target.
    The draft's ids: draft.aux_layer_ids, else the capture's choice for this algorithm, else
    the algorithm's default; a capture holding more layers serves each draft its subset.
    Online, the dataset is the prepared samples (their states come from the run's source) and
    the vocabulary the one a capture of them would have built."""
    algo = get(cfg.algorithm)
    if cfg.online.enabled:
        ds, summary = load_prepared(cfg.data)
        if summary["target_sha256"] != target.content_hash:
            raise DraftsmithError(f"'{cfg.data}' was prepared with {summary['target']}, not {target.name}; prepare it "
                                  "with this target")
        n = min(len(ds), cfg.max_samples or len(ds))  # the vocabulary of the samples the run trains on
        counts = sum(token_counts(b["input_ids"], b["loss_mask"], target.vocab_size)
                     for b in ds.select(range(n)).iter(1024))
        size = cfg.online.draft_vocab_size or cfg.draft.draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE
        d2t, t2d = build_draft_vocab(counts, min(size, target.vocab_size))
        ids = list(cfg.draft.aux_layer_ids or algo.default_layer_ids(target.num_layers))
        target.check_layer_ids(ids)
        return PreparedSamples(ds, cfg.max_length), ids, d2t, t2d, counts, {
            "prepared": str(cfg.data), "online": cfg.online.engine, "chat_template": summary.get("chat_template")}
    info = verify_capture(cfg.data)  # manifest complete, shards intact and as described (hashed once here)
    manifest = info.manifest
    made_by = manifest["target"]
    have = (("sha256", target.content_hash), ("hidden_size", target.hidden_size),
            ("vocab_size", target.vocab_size), ("num_layers", target.num_layers))
    mismatch = [f"{k} {made_by[k]} != {v}" for k, v in have if made_by[k] != v]
    if mismatch:
        raise DraftsmithError(f"capture '{cfg.data}' was made from {made_by['name']}, not this target ({target.name}): "
                              f"{'; '.join(mismatch)}; capture again with this target")
    ids = list(cfg.draft.aux_layer_ids or manifest["draft_layer_ids"].get(cfg.algorithm)
               or algo.default_layer_ids(target.num_layers))
    vocab = load_file(info.path / DRAFT_VOCAB)
    dataset = CapturedSamples(info.path, cfg.max_length, ids)  # refuses ids the capture does not hold
    return dataset, ids, vocab["d2t"], vocab["t2d"], vocab["counts"], {
        "capture": str(cfg.data), "chat_template": manifest["data"].get("chat_template")}


def run(cfg: TrainConfig, argv: list[str] | None = None) -> dict:
    # resolve and check, before any work: the output folder, what resume needs, servability
    source = resolve_target(cfg.target)
    out = guard_output(cfg.output_dir, [cfg.data, source.path], "train", cfg.overwrite and cfg.resume is None)
    if out.exists() and cfg.resume is None and any(out.iterdir()) and not cfg.overwrite:
        raise DraftsmithError(f"output_dir '{out}' exists; pass resume=latest to continue or overwrite=true")
    if cfg.resume is not None and not out.is_dir():
        raise DraftsmithError(f"resume={cfg.resume} but output_dir '{out}' does not exist; drop resume to start fresh")
    data = trained_on(cfg.data)
    if cfg.resume is not None:
        check_resumed_data(out, cfg.resume, data)
    servable_warnings = check_servable(source, [VLLM_METHOD[cfg.algorithm]], cfg.require_servable, "train")
    created = not out.exists() or (cfg.overwrite and cfg.resume is None)
    accelerator = make_accelerator(cfg, out)
    if accelerator.is_main_process:
        for line in servable_warnings:
            print(line, file=sys.stderr)
        if cfg.overwrite and cfg.resume is None and out.exists():
            shutil.rmtree(out)
        ensure_dir(out, "output_dir")
        claim_output(out, "train")  # overwrite=true may replace what a killed run leaves
        if cfg.resume is None:  # what its checkpoints are trained on: a resumed run must train on the same
            atomic_write_json(out / TRAINED_ON, data)
    accelerator.wait_for_everyone()
    # produce (the loop) and publish (the trained draft folder)
    try:
        return _train(cfg, argv, accelerator, out, source)
    except BaseException:
        if created and accelerator.is_main_process and not complete_checkpoints(out):
            shutil.rmtree(out, ignore_errors=True)  # a failed run leaves no folder behind (checkpoints stay)
        raise


TRAINED_ON = ".draftsmith-data.json"  # beside checkpoints/: the data the run's checkpoints were trained on


def trained_on(data: str) -> dict:
    """The data a run trains on: its folder and the sha256 of the file that describes it whole (a
    capture's manifest.json, a prepared folder's summary.json, each holding its data's digests)."""
    folder = Path(data).expanduser()
    described = next((folder / n for n in ("manifest.json", "summary.json") if (folder / n).is_file()), None)
    return {"data": str(folder.resolve()), "sha256": sha256_file(described) if described else None}


def check_resumed_data(out: Path, resume: str, data: dict) -> None:
    """A resumed run trains on the data its checkpoints were trained on, or is refused in one line
    (resumed on other data, the draft would name only the new data)."""
    record = (out if resume == "latest" else Path(resume).parent.parent) / TRAINED_ON
    try:
        before = json.loads(record.read_text())
    except (OSError, ValueError):
        return  # a run from before the record was kept
    if before.get("sha256") != data["sha256"]:
        raise DraftsmithError(f"resume={resume}: the checkpoints in '{record.parent / 'checkpoints'}' were trained on "
                              f"data={before.get('data')}, not data={data['data']} (another capture or prepared "
                              "folder); pass that data= to continue the run, or start a new output_dir")


def _train(cfg: TrainConfig, argv, accelerator, out: Path, source) -> dict:
    set_seed(cfg.seed)
    algo = get(cfg.algorithm)

    # The frozen target: its embedding feeds the draft; its head gives the training targets.
    # Only the embedding, final norm and LM head are read (the decoder layers are never loaded)
    # unless this run's own processes make the states (online.engine=hf).
    target = load_target(source, "float32" if accelerator.device.type == "cpu" else "bfloat16", accelerator.device,
                         head_only=not cfg.online.hf_in_process)
    dataset, aux_ids, d2t, t2d, counts, data_desc = load_data(cfg, target)
    if dataset.skipped:  # never cut: a longer sample is skipped, said here and counted in the data record
        data_desc["skipped_longer_than_max_length"] = {"max_length": cfg.max_length, "samples": dataset.skipped}
        if accelerator.is_main_process:
            print(f"train: {dataset.skipped} of {dataset.skipped + len(dataset)} samples are longer than max_length "
                  f"{cfg.max_length} tokens: skipped (raise max_length, or null to train on every sample whole)",
                  file=sys.stderr)
        if not len(dataset):
            raise DraftsmithError(f"every sample of '{cfg.data}' is longer than max_length {cfg.max_length}; raise it "
                                  "or set max_length=null")
    online = None
    if cfg.online.enabled:  # this rank's source of states: the target here, or vLLM producers
        engine_len = served_max_model_len(target.model.config.get_text_config(), dataset.longest + 1)
        online = open_online(cfg.online, target=target, prepared=dataset, layer_ids=aux_ids,
                             max_model_len=engine_len, out=out, rank=accelerator.process_index,
                             world=accelerator.num_processes, barrier=accelerator.wait_for_everyone)
        if accelerator.is_main_process:
            print(online.summary, file=sys.stderr)  # what the buffer costs (and the producer's dtype)
        dataset = StreamedSamples(dataset, online.source)
    if cfg.max_samples is not None and cfg.max_samples < len(dataset):  # a data budget: the first N samples
        dataset = torch.utils.data.Subset(dataset, range(cfg.max_samples))
        data_desc["max_samples"] = cfg.max_samples
    draft_cfg = dataclasses.replace(cfg.draft).fill_from_target(target.model.config.get_text_config(), aux_ids,
                                                                 int(d2t.numel()))
    draft_cfg = algo.fill_from_data(draft_cfg, counts, target.tokenizer.all_special_ids)
    Vd = draft_cfg.draft_vocab_size
    if Vd is not None and Vd != d2t.numel():  # a smaller draft vocabulary than the capture's
        d2t, t2d = build_draft_vocab(counts, Vd)
    draft = build(cfg.algorithm, draft_cfg, target)
    draft.set_vocab(d2t, t2d)
    model = TrainStep(cfg.algorithm, draft)
    draft.gradient_checkpointing = cfg.gradient_checkpointing

    generator = torch.Generator().manual_seed(cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, collate_fn=collate, generator=generator)
    updates_per_epoch = math.ceil(len(loader) / accelerator.num_processes / cfg.gradient_accumulation_steps)
    total_steps = min(cfg.max_steps or 10**12, cfg.epochs * updates_per_epoch)
    check_space(out, bytes_written(draft, total_steps // cfg.save_every, cfg.keep_last),
                f"train into '{out}' (the trained draft and its checkpoints)",
                "keep fewer checkpoints (keep_last), save less often (save_every), or choose another output_dir")
    if cfg.optimizer == "muon" and flag("ACCELERATE_USE_DEEPSPEED"):
        raise DraftsmithError("optimizer=muon does not run under DeepSpeed ZeRO (it partitions flattened gradients; "
                              "Muon orthogonalizes whole matrices): launch with DDP, or use optimizer=adamw")
    ns_dtype, line = muon_ns_dtype(cfg.muon_ns_dtype, accelerator.device)
    optimizers = build_optimizers(model.named_parameters(), cfg, ns_dtype)  # AdamW, or Muon and AdamW side by side
    if cfg.optimizer == "muon" and line and accelerator.is_main_process:
        print(f"train: {line}")
    schedulers = [build_schedule(o, cfg, total_steps) for o in optimizers]
    model, loader, *prepared = accelerator.prepare(model, loader, *optimizers, *schedulers)
    optimizers, schedulers = prepared[:len(optimizers)], prepared[len(optimizers):]
    effective = check_effective(cfg, accelerator, model)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if cfg.resume is not None:
        accelerator.load_state(_checkpoint_dir(out, cfg.resume))
    if accelerator.is_main_process:
        accelerator.init_trackers("draftsmith", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                         if isinstance(v, (int, float, str, bool))})
    t0 = time.perf_counter()
    run = Training(cfg, accelerator, algo, target, draft, model, optimizers, schedulers, loader, progress, total_steps,
                   out, online, draft_cfg.num_positions)
    try:
        history, tokens = run.loop()
    finally:
        if online is not None:
            online.close()
    accelerator.wait_for_everyone()
    report = {"steps": progress.step, "history": history, "final": history[-1] if history else {},
              "world_size": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
              "algorithm": cfg.algorithm, "effective": effective, "total_steps": total_steps,
              "optimization": optimization(cfg),
              **({"muon_ns_dtype": str(ns_dtype).removeprefix("torch.")} if cfg.optimizer == "muon" else {}),
              "tokens": tokens,  # non-padding tokens of the samples trained on, all processes
              "seconds": time.perf_counter() - t0,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # this process
    _check_weights(accelerator, model, "the trained draft")
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards; every rank must call it
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model).draft
        save_draft(out, cfg.algorithm, unwrapped, {k.removeprefix("draft."): v for k, v in state.items()},
                   target, data_desc, progress.step)
        atomic_write_json(out / "train_report.json", report)
        write_run_files(out, to_yaml(cfg), {"target": target.name, "target_sha256": target.content_hash,
                                            "seed": cfg.seed, "world_size": accelerator.num_processes,
                                            "algorithm": cfg.algorithm,
                                            **{k: v for k, v in data_desc.items() if k != "chat_template"}}, argv,
                        stage="train")
    accelerator.end_training()
    return report


@dataclasses.dataclass
class Training:
    """One training run's state, set up by `_train` (the target, the draft and its wrapped model, the
    optimizers and their schedules, the data, where the loop stands, this rank's online source)
    and run by `loop`."""

    cfg: TrainConfig
    accelerator: Accelerator
    algo: ModuleType  # the algorithm's module (trainer/drafts/registry.py get)
    target: Target
    draft: torch.nn.Module
    model: torch.nn.Module  # TrainStep(draft), as accelerate prepared it
    optimizers: list
    schedulers: list
    loader: DataLoader
    progress: Progress
    total_steps: int
    out: Path
    online: object | None  # trainer/online/run.py open_online's handle, or None
    positions: int  # the draft positions a step trains and measures

    def loop(self) -> tuple[list[dict], float]:
        """The training loop, from where `progress` stands: (the history logged, the tokens trained on)."""
        cfg, accelerator, algo, target, draft, model = (self.cfg, self.accelerator, self.algo, self.target,
                                                        self.draft, self.model)
        optimizers, schedulers, loader, progress = self.optimizers, self.schedulers, self.loader, self.progress
        total_steps, out, online = self.total_steps, self.out, self.online
        window = _Window(self.positions, accelerator.device)
        history = []
        bar = tqdm(total=total_steps, initial=progress.step, desc="train", unit="step",
                   disable=not accelerator.is_local_main_process)
        t0, tokens = time.perf_counter(), 0
        update_loss = torch.zeros((), device=accelerator.device)  # this update's micro-batch losses, summed
        while progress.step < total_steps:
            if online is not None:  # the epoch's plan: the samples this rank takes, from where a resumed run stands
                plan, start = epoch_plan(loader, progress.epoch, progress.micro_in_epoch)
                online.source.begin(plan, start)
            elif hasattr(loader, "set_epoch"):
                loader.set_epoch(progress.epoch)
            epoch_loader = accelerator.skip_first_batches(loader, progress.micro_in_epoch) if progress.micro_in_epoch \
                else loader
            for batch in epoch_loader:
                progress.micro_in_epoch += 1
                batch = dequantize_states(batch)  # float8 states, on the device
                with accelerator.accumulate(model):
                    labels = algo.target_labels(target, batch, draft)  # no grad
                    with accelerator.autocast():
                        metrics = model(batch, labels)
                    metrics.loss = faults.maybe_nan(faults.TRAIN_NAN_LOSS_AT_STEP, progress.step + 1, metrics.loss)
                    update_loss = update_loss + metrics.loss.detach().float()
                    if accelerator.sync_gradients:  # the update's last micro-batch: checked before any weight moves
                        _check_update_loss(accelerator, update_loss, progress.step + 1, out, cfg, bar)
                        update_loss = torch.zeros((), device=accelerator.device)
                    accelerator.backward(metrics.loss)  # DeepSpeed steps its optimizer inside backward
                    if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)  # DeepSpeed: its own
                    for optimizer in optimizers:
                        optimizer.step()
                    if accelerator.sync_gradients:  # once per optimizer update (see make_accelerator)
                        for scheduler in schedulers:
                            scheduler.step()
                    for optimizer in optimizers:
                        optimizer.zero_grad()
                window.add(metrics, batch["attention_mask"].sum())
                if not accelerator.sync_gradients:
                    continue
                progress.step += 1
                bar.update(1)
                if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                    stats = window.reduce(accelerator)  # tokens: all processes, since the last log line
                    tokens += stats.pop("tokens")
                    elapsed = time.perf_counter() - t0
                    stats.update(step=progress.step, lr=schedulers[-1].get_last_lr()[0], tokens_per_s=tokens / elapsed)
                    if online is not None:  # which side waits: the trainer for states, or the producer on a full buffer
                        if hasattr(online.source, "refresh"):
                            online.source.refresh()
                        stats["online"] = online.source.stats.line(elapsed)
                    history.append(stats)
                    scalars = {**stats, **{f"online/{k}": v for k, v in stats.get("online", {}).items()}}
                    accelerator.log({k: v for k, v in scalars.items() if isinstance(v, (int, float))},
                                    step=progress.step)
                    bar.set_postfix(loss=f"{stats['loss']:.3f}", tau=f"{stats['tau']:.2f}",
                                    tok_s=f"{stats['tokens_per_s']:.0f}",
                                    **({"online": stats["online"]["bound"]} if online is not None else {}))
                if progress.step % cfg.save_every == 0:
                    save_checkpoint(accelerator, model, out, progress.step // cfg.save_every, cfg.keep_last)
                faults.maybe_die(faults.TRAIN_AFTER_STEPS, progress.step)  # tests: a kill between checkpoints
                if progress.step >= total_steps:
                    break
            else:
                progress.epoch += 1
                progress.micro_in_epoch = 0
        bar.close()
        return history, tokens


def bytes_written(draft, saves: int, keep_last: int) -> int:
    """What a run writes at most: the trained draft (its state, as saved) and, when it saves any,
    keep_last + 1 checkpoints at once (the new one is complete before the oldest goes), each the
    model's state and AdamW's two moments per trainable weight (accelerate's save_state; the
    scheduler, RNG and loop position are small)."""
    state = sum(t.numel() * t.element_size() for t in draft.state_dict().values())
    moments = 2 * sum(p.numel() * 4 for p in draft.parameters() if p.requires_grad)  # float32 exp_avg, exp_avg_sq
    return state + min(saves, keep_last + 1) * (state + moments) + (1 << 20)


def _check_update_loss(accelerator, update_loss: torch.Tensor, step: int, out: Path, cfg: TrainConfig, bar) -> None:
    """Stop before optimizer step `step` when its loss, summed over every rank (one scalar, so
    every rank stops together), is not finite: the weights and every checkpoint stay finite."""
    total = float(accelerator.reduce(update_loss, reduction="sum"))
    if math.isfinite(total):
        return
    bar.close()
    kept = complete_checkpoints(out)
    where = (f"the newest checkpoint ({kept[-1].name}) holds finite weights: resume=latest with a lower "
             "learning_rate" if kept else "no checkpoint was written yet: lower learning_rate and start again")
    raise DraftsmithError(f"step {step}: the loss is {total}, not finite, so no weight was updated with it; the "
                          f"states may hold inf/NaN (`draftsmith inspect-capture {cfg.data}`) or the learning rate "
                          f"is too high; {where}")


def _check_weights(accelerator, model, what: str) -> None:
    """Refuse to write `what` from non-finite weights (each rank checks what it holds: a ZeRO
    shard or the whole model; one flag across ranks, so every rank stops together)."""
    flags = [~torch.isfinite(p.detach()).all() for p in model.parameters() if p.numel()]  # one read, not one a tensor
    bad = torch.stack(flags).sum().float() if flags else torch.zeros((), device=accelerator.device)
    if float(accelerator.reduce(bad, reduction="sum")):
        raise DraftsmithError(f"the draft's weights hold inf/NaN, so {what} is not written (the earlier checkpoints "
                              "are kept); resume=latest with a lower learning_rate")


def complete_checkpoints(out: Path) -> list[Path]:
    """checkpoints/checkpoint_<k>, oldest first. Only complete ones carry that name: a
    checkpoint is written as .checkpoint_<k>.partial and renamed when every file is in."""
    found = [p for p in (out / "checkpoints").glob("checkpoint_*") if p.is_dir() and p.name[11:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[11:]))


def save_checkpoint(accelerator, model, out: Path, index: int, keep_last: int) -> None:
    """accelerate's save_state (model, optimizer, scheduler, RNG, loop position) into a staging
    folder, published as checkpoints/checkpoint_<index> by one rename once all ranks are done;
    a kill at any moment leaves the newest complete checkpoint as `latest`. Keeps `keep_last`, and
    never writes non-finite weights (so `keep_last` never rotates the finite ones away)."""
    _check_weights(accelerator, model, f"checkpoint_{index}")
    root = out / "checkpoints"
    staging, final = root / f".checkpoint_{index}.partial", root / f"checkpoint_{index}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    faults.maybe_die(faults.TRAIN_IN_CHECKPOINT, index)  # tests: a kill inside the checkpoint write
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # an earlier run's checkpoint of the same index, superseded
            shutil.rmtree(final)
        os.rename(staging, final)
        for old in complete_checkpoints(out)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def optimization(cfg) -> dict:
    """How the draft was trained (the report's, and so the model card's): the optimizer, its rates and
    the schedule. The objective is the draft's own config (`draft.loss`, `draft.loss_on`)."""
    out = {"optimizer": cfg.optimizer, "learning_rate": cfg.learning_rate, "lr_schedule": cfg.lr_schedule}
    if cfg.optimizer == "muon":
        out["muon_lr"] = cfg.muon_lr or cfg.learning_rate
    return out


def _checkpoint_dir(out: Path, resume: str) -> str:
    if resume != "latest":
        if not Path(resume, "model.safetensors").is_file() and not any(Path(resume).glob("pytorch_model*")):
            raise DraftsmithError(f"resume={resume}: not a checkpoint folder (e.g. {out}/checkpoints/checkpoint_N); "
                                  "pass resume=latest or an existing checkpoint")
        return resume
    ckpts = complete_checkpoints(out)
    if not ckpts:
        raise DraftsmithError(f"resume=latest but '{out}/checkpoints' holds no complete checkpoint; drop resume to "
                              "start fresh")
    return str(ckpts[-1])


class _Window:
    """Sums since the last log line, kept on the device: [loss, micro-batches, tokens, then per
    draft position: correct, counted, Σ α, α's rows] (the K positions the algorithm trains:
    StepMetrics; α = Σ_v min(p, q), a position's acceptance under rejection sampling, where the
    objective reads the target's distribution). The host reads them only when logging, so the
    loop has no sync per micro-batch."""

    def __init__(self, k: int, device):
        self.k, self.device = k, device
        self.reset()

    def reset(self):
        self.sums = torch.zeros(3 + 4 * self.k, device=self.device)

    def add(self, m, tokens: torch.Tensor):
        none = torch.zeros(self.k, device=self.device)
        alpha, rows = (m.alpha, m.alpha_rows) if m.alpha is not None else (none, none)
        self.sums += torch.cat([torch.stack([m.loss.detach().float(), torch.ones((), device=self.device),
                                             tokens.float()]), m.correct.float(), m.count.float(), alpha.float(),
                                rows.float()])

    def reduce(self, accelerator) -> dict:
        packed = accelerator.reduce(self.sums, reduction="sum").cpu()
        loss, n, tokens = packed[:3].tolist()
        correct, count, alpha, rows = packed[3:].split(self.k)
        acc = (correct / count.clamp(min=1)).tolist()
        self.reset()
        stats = {"loss": loss / max(n, 1), "acc": acc, "tau": simulated_tau(acc), "tokens": tokens}
        if bool((rows > 0).any()):  # teacher-forced acceptance per position under rejection sampling
            stats["alpha"] = (alpha / rows.clamp(min=1)).tolist()
        return stats


def format_report(r: dict) -> str:
    f = r["final"]
    return (f"trained {r['algorithm']} {r['steps']} steps on {r['world_size']} process(es) "
            f"(effective batch {r['effective']['effective_batch']}) in {r['seconds']:.0f} s: "
            f"loss {f.get('loss', float('nan')):.3f}, simulated τ {f.get('tau', float('nan')):.2f}, "
            f"{f.get('tokens_per_s', 0):.0f} tokens/s\n  per-step accuracy "
            + " ".join(f"{a:.2f}" for a in f.get("acc", []))
            + ("\n  per-position acceptance α " + " ".join(f"{a:.2f}" for a in f["alpha"]) if f.get("alpha") else ""))


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(TrainConfig, argv, __doc__, prog="recipes/train.py")
    report = run(cfg, argv)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_report(report))
        print(f"  written to {cfg.output_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
