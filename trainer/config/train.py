"""The `train` stage's schema (recipes/train.py): a draft trained on a capture or online."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from trainer.config.loader import load_section
from trainer.data.shards import STORE_DTYPES
from trainer.drafts.registry import get
from trainer.errors import ConfigError
from trainer.layer_ids import check_layer_ids
from trainer.optim import MUON_LR_ADJUST, OPTIMIZERS, SCHEDULES
from trainer.target import DEFAULT_TARGET, TARGET_DTYPES

ONLINE_ENGINES = ("hf", "vllm")


@dataclass
class OnlineConfig:
    """Train without a capture: the target's hidden states made while the draft trains
    (trainer/online/), handed over sample by sample through a bounded buffer."""

    # null: train on a capture (data = its folder). hf: the target in the trainer's own processes
    # (targets that fit beside the draft); vllm: the target served by vLLM in its own environment
    # and devices, streaming to every trainer rank through Ray (targets of any size). data = a
    # prepared folder either way.
    engine: str | None = None
    buffer_tokens: int = 65536  # tokens of states each trainer rank's buffer holds at most
    store_dtype: str = "float32"  # the rounding a capture would apply: float32 | bfloat16 | float16 | float8_e4m3
    # vllm: the dtype the producer runs the target in (null: the target's own, its config's dtype;
    # float32 where it names none). hf runs it in the trainer's (float32 on the CPU, else bfloat16)
    target_dtype: str | None = None
    max_tokens_per_batch: int = 4096  # hf: padded tokens per target forward (1: every sample alone)
    draft_vocab_size: int | None = None  # the vocabulary built from the data; null: the draft's, else 32000
    timeout_s: float = 600.0  # a producer that hands over nothing for this long, once it has started, ends the run
    # vllm: the longest the producer may take to hand a rank its first states (its engine's start: a
    # large target loads for minutes) before the run ends
    start_timeout_s: float = 3600.0
    # Epochs after the first re-run the target, except for the first cache_tokens tokens' states,
    # kept on local disk while the run lasts (0: none; the disk it costs: cache_tokens x bytes/token)
    cache_tokens: int = 0
    address: str | None = None  # a Ray cluster to join ("auto", host:port); null: one started here
    # hf: the Ray resources each producer asks for (e.g. {producer_node: 1}, a resource a node was
    # started with: `ray start --resources='{"producer_node": 1}'`; CPU and GPU as Ray counts
    # them): the target then runs in Ray actors on such nodes, not in the trainer processes; so it
    # does with online.address or data_parallel_size > 1 set (docs/online-cluster.md)
    producer_resources: dict[str, float] | None = None
    devices: list[str] | None = None  # vllm: the producer's devices (null: the visible ones)
    tensor_parallel_size: int = 1  # vllm: devices per engine
    pipeline_parallel_size: int = 1  # vllm: pipeline stages per engine
    data_parallel_size: int = 1  # producers side by side, sharing every rank's stream
    concurrency: int = 8  # vllm: sequences an engine prefills together (its max_num_seqs)
    # vllm: the fraction of each device an engine takes (null: vLLM's 0.9); below it, a trainer
    # sharing the device keeps the rest (one GPU holding both)
    gpu_memory_utilization: float | None = None

    @property
    def enabled(self) -> bool:
        return self.engine is not None

    @property
    def hf_in_process(self) -> bool:
        """hf with the target in each trainer process (no Ray producers)."""
        return self.engine == "hf" and not (self.address or self.producer_resources or self.data_parallel_size > 1)


@dataclass
class TrainConfig:
    """`recipes/train.py`: a draft trained on a capture (offline) or online, its states made by
    the target while it trains (`online.engine`)."""

    data: str = MISSING  # a capture folder, or with online.engine set a prepared-data folder
    output_dir: str = MISSING
    algorithm: str = "eagle3"  # a key of trainer.drafts.registry.DRAFTS
    target: str = DEFAULT_TARGET
    online: OnlineConfig = field(default_factory=OnlineConfig)
    # The draft's shape and objective: the `Config` of the chosen algorithm's module
    # (trainer/drafts/<algorithm>.py), checked against that schema at load time.
    draft: dict[str, Any] = field(default_factory=dict)
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; caps epochs
    max_samples: int | None = None  # train on the first N samples of the data only (a data budget); null: all
    batch_size: int = 1  # samples per process per micro-batch
    gradient_accumulation_steps: int = 1
    # tokens per sample: a longer one is skipped, never cut, counted in one line and in the trained
    # folder's data record; null: every sample whole (prepare bounded them by the target's context)
    max_length: int | None = None
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 0.5
    # adamw, or muon: torch.optim.Muon on the draft's 2-D weight matrices, AdamW (learning_rate,
    # weight_decay) on the rest (trainer/optim.py); muon_lr null: learning_rate
    optimizer: str = "adamw"
    muon_lr: float | None = None
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_adjust_lr_fn: str = "match_rms_adamw"  # torch's Muon: original | match_rms_adamw (AdamW's update RMS)
    # cosine (warmup, then cosine to 0), or wsd: warmup, constant, then linear to 0 over the last
    # decay_fraction of the steps (a stable-phase checkpoint resumed with a smaller max_steps decays there)
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2
    mixed_precision: str = "auto"  # auto: bf16 on an accelerator, fp32 on CPU; or "no" | "bf16"
    gradient_checkpointing: bool = False
    save_every: int = 100  # optimizer steps between `save_state` checkpoints
    keep_last: int = 2  # checkpoints kept
    resume: str | None = None  # "latest" or a checkpoint directory
    log_every: int = 10
    seed: int = 0
    overwrite: bool = False
    require_servable: bool = False  # as capture's: an error, not a warning, when vLLM cannot serve the draft

    def validate(self) -> None:
        refused = getattr(get(self.algorithm), "REFUSED_DRAFT_KEYS", {})  # {key: why}: one line, before the schema
        for key in refused:
            if isinstance(self.draft, dict) and self.draft.get(key) is not None:
                raise ConfigError(refused[key])
        self.draft = load_section(get(self.algorithm).Config, self.draft, "draft")
        o = self.online
        if o.engine is not None and o.engine not in ONLINE_ENGINES:
            raise ConfigError(f"online.engine={o.engine!r}; use hf or vllm (or null to train on a capture)")
        if o.store_dtype not in STORE_DTYPES or o.target_dtype not in (None, *TARGET_DTYPES):
            raise ConfigError(f"online.store_dtype is one of {', '.join(STORE_DTYPES)}, online.target_dtype one of "
                              f"{', '.join(TARGET_DTYPES)} (or null: the target's own)")
        for key in ("buffer_tokens", "max_tokens_per_batch", "tensor_parallel_size", "pipeline_parallel_size",
                    "data_parallel_size", "concurrency"):
            if getattr(o, key) < 1:
                raise ConfigError(f"online.{key}={getattr(o, key)}; use >= 1")
        if o.timeout_s <= 0:
            raise ConfigError(f"online.timeout_s={o.timeout_s:g}; use > 0 (seconds without states before the run ends)")
        if o.cache_tokens < 0:
            raise ConfigError(f"online.cache_tokens={o.cache_tokens}; use >= 0 (0: no cache)")
        if not (o.gpu_memory_utilization is None or 0 < o.gpu_memory_utilization <= 1):
            raise ConfigError(f"online.gpu_memory_utilization={o.gpu_memory_utilization:g}; use a fraction in (0, 1], "
                              "or null for vLLM's 0.9")
        if o.start_timeout_s <= 0:
            raise ConfigError(f"online.start_timeout_s={o.start_timeout_s:g}; use > 0 (the seconds the producer may "
                              "take to start and hand its first states)")
        vllm_only = o.devices or o.gpu_memory_utilization or o.target_dtype or max(
            o.tensor_parallel_size, o.pipeline_parallel_size) > 1
        if o.engine == "hf" and vllm_only:
            raise ConfigError("online.devices, gpu_memory_utilization, target_dtype and "
                              "tensor/pipeline_parallel_size are online.engine=vllm settings; the hf engine runs "
                              "in the trainer's dtype (float32 on the CPU, else bfloat16), placed by "
                              "online.producer_resources")
        if o.engine == "vllm" and o.producer_resources:
            raise ConfigError("online.producer_resources places hf producers on Ray nodes; vLLM producers run on "
                              "the first trainer rank's machine, on online.devices")
        bad = {k: v for k, v in (o.producer_resources or {}).items() if not v > 0}
        if bad:
            raise ConfigError(f"online.producer_resources={dict(o.producer_resources)}: {', '.join(bad)} must be > 0 "
                              "(the amount of that Ray resource each producer asks for)")
        if self.draft.aux_layer_ids is not None:
            check_layer_ids(self.draft.aux_layer_ids, "draft.aux_layer_ids")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ConfigError(f"mixed_precision={self.mixed_precision!r}; use auto, no, bf16 or fp16")
        for key in ("epochs", "batch_size", "gradient_accumulation_steps", "save_every", "keep_last",
                    "log_every", "max_length"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps}; use >= 1, or null to train `epochs` full epochs")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"max_samples={self.max_samples}; use >= 1, or null for every sample of the data")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ConfigError("learning_rate must be > 0, warmup_steps and max_grad_norm >= 0")
        for key, allowed in (("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES),
                             ("muon_adjust_lr_fn", MUON_LR_ADJUST)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{key}={getattr(self, key)}; use one of {', '.join(allowed)}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"decay_fraction={self.decay_fraction:g}; use a fraction of the steps in (0, 1]")
        if (self.muon_lr is not None and self.muon_lr <= 0) or not 0 <= self.muon_momentum < 1 \
                or self.muon_weight_decay < 0:
            raise ConfigError("muon_lr must be > 0 (or null: learning_rate), muon_momentum in [0, 1), "
                              "muon_weight_decay >= 0")
