"""The `train` stage's schema (recipes/train.py): a draft trained on a capture or online."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config.loader import load_section
from trainer.data.shards import STORE_DTYPES
from trainer.drafts.registry import get
from trainer.errors import ConfigError
from trainer.layer_ids import check_layer_ids
from trainer.optim import MUON_LR_ADJUST, MUON_NS_DTYPES, OPTIMIZERS, SCHEDULES
from trainer.settings import setting
from trainer.target import DEFAULT_TARGET, TARGET_DTYPES

ONLINE_ENGINES = ("hf", "vllm")


@dataclass
class OnlineConfig:
    """Train without a capture: the target's hidden states made while the draft trains
    (trainer/online/), handed over sample by sample through a bounded buffer."""

    engine: str | None = setting(None, "where the states come from: null, a capture (data = its folder); hf, the "
                                       "target in the trainer's own processes (targets that fit beside the draft); "
                                       "vllm, the target served by vLLM in its own environment and devices, "
                                       "streaming to every trainer rank through Ray (targets of any size); data = a "
                                       "prepared folder either way", choices=ONLINE_ENGINES)
    buffer_tokens: int = setting(65536, "tokens of states each trainer rank's buffer holds at most", ge=1)
    store_dtype: str = setting("float32", "the rounding a capture would apply", choices=STORE_DTYPES)
    target_dtype: str | None = setting(None, "vllm: the dtype the producer runs the target in (null: the target's "
                                             "own, its config's dtype; float32 where it names none); hf runs it in "
                                             "the trainer's (float32 on the CPU, else bfloat16)",
                                       choices=TARGET_DTYPES)
    max_tokens_per_batch: int = setting(4096, "hf: padded tokens per target forward (1: every sample alone)", ge=1)
    draft_vocab_size: int | None = setting(None, "the vocabulary built from the data; null: the draft's, else "
                                                 "32000", ge=1)
    timeout_s: float = setting(600.0, "seconds a producer may hand over nothing, once it has started, before the "
                                      "run ends", gt=0)
    start_timeout_s: float = setting(3600.0, "seconds the producer may take to hand a rank its first states (its "
                                             "engine's start: a large target loads for minutes) before the run ends",
                                     gt=0)
    cache_tokens: int = setting(0, "tokens whose states are kept on local disk while the run lasts, so that epochs "
                                   "after the first do not re-run the target for them (0: none; the disk it costs: "
                                   "cache_tokens x bytes/token)", ge=0)
    address: str | None = setting(None, "a Ray cluster to join (auto, host:port); null: one started here")
    producer_resources: dict[str, float] | None = setting(None, "the Ray resources each producer asks for (e.g. "
                                                                "{producer_node: 1}, a resource a node was started "
                                                                "with; GPU: the devices a vLLM producer gets there): "
                                                                "each producer runs on such a node, this machine or "
                                                                "another; hf: so it does with address or "
                                                                "data_parallel_size > 1 set (docs/online-cluster.md)",
                                                          gt=0)
    devices: list[str] | None = setting(None, "vllm: the devices of the producers started on this machine; null: "
                                              "the visible ones")
    tensor_parallel_size: int = setting(1, "vllm: devices per engine", ge=1)
    pipeline_parallel_size: int = setting(1, "vllm: pipeline stages per engine", ge=1)
    data_parallel_size: int = setting(1, "producers side by side, sharing every rank's stream", ge=1)
    concurrency: int = setting(8, "vllm: sequences an engine prefills together (its max_num_seqs)", ge=1)
    gpu_memory_utilization: float | None = setting(None, "vllm: the fraction of each device an engine takes (null: "
                                                         "vLLM's 0.9); below it, a trainer sharing the device keeps "
                                                         "the rest (one GPU holding both)", gt=0, le=1)

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

    data: str = setting(help="the data: a capture folder, or with online.engine set a prepared-data folder")
    output_dir: str = setting(help="the trained draft's folder (its checkpoints inside)")
    algorithm: str = setting("eagle3", "the draft algorithm: a key of trainer.drafts.registry.DRAFTS")
    target: str = setting(DEFAULT_TARGET, "the target: an embedded alias, an HF model folder or a .gguf file")
    online: OnlineConfig = setting(help="online training: the states made while the draft trains",
                                   factory=OnlineConfig)
    draft: dict[str, Any] = setting(help="the draft's shape and objective: the Config of the chosen algorithm's "
                                         "module (trainer/drafts/<algorithm>.py), checked against that schema at "
                                         "load time", factory=dict)
    epochs: int = setting(1, "passes over the data", ge=1)
    max_steps: int | None = setting(None, "optimizer steps at most; caps epochs; null: `epochs` full epochs", ge=1)
    max_samples: int | None = setting(None, "samples trained on: the data's first N only (a data budget); null: all",
                                      ge=1)
    batch_size: int = setting(1, "samples per process per micro-batch", ge=1)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", ge=1)
    max_length: int | None = setting(None, "tokens per sample at most: a longer one is skipped, never cut, counted "
                                           "in one line and in the trained folder's data record; null: every sample "
                                           "whole (prepare bounded them by the target's context)", ge=1)
    learning_rate: float = setting(1e-4, "the peak learning rate (AdamW's)", gt=0)
    weight_decay: float = setting(0.0, "AdamW's weight decay", ge=0)
    warmup_steps: int = setting(10, "optimizer steps of linear warmup", ge=0)
    max_grad_norm: float = setting(0.5, "the gradient norm clipped to; 0: no clipping", ge=0)
    optimizer: str = setting("adamw", "the optimizer: adamw, or muon (torch.optim.Muon on the draft's 2-D weight "
                                      "matrices, AdamW with learning_rate and weight_decay on the rest: "
                                      "trainer/optim.py)", choices=OPTIMIZERS)
    muon_lr: float | None = setting(None, "Muon's learning rate; null: learning_rate", gt=0)
    muon_momentum: float = setting(0.95, "Muon's momentum", ge=0, lt=1)
    muon_weight_decay: float = setting(0.1, "Muon's weight decay", ge=0)
    muon_adjust_lr_fn: str = setting("match_rms_adamw", "torch's Muon learning-rate adjustment: original, or "
                                                        "match_rms_adamw (AdamW's update RMS)", choices=MUON_LR_ADJUST)
    muon_ns_dtype: str = setting("auto", "the dtype of Muon's Newton-Schulz iteration: auto (torch's bfloat16, "
                                         "float32 on a CPU without bfloat16 matmul, where bfloat16 is 23-75x "
                                         "slower), bfloat16, or float32", choices=MUON_NS_DTYPES)
    lr_schedule: str = setting("cosine", "the schedule: cosine (warmup, then cosine to 0), or wsd (warmup, "
                                         "constant, then linear to 0 over the last decay_fraction of the steps: a "
                                         "stable-phase checkpoint resumed with a smaller max_steps decays there)",
                               choices=SCHEDULES)
    decay_fraction: float = setting(0.2, "wsd: the fraction of the steps spent decaying", gt=0, le=1)
    mixed_precision: str = setting("auto", "auto: bf16 on an accelerator, fp32 on CPU; or no | bf16 | fp16",
                                   choices=("auto", "no", "bf16", "fp16"))
    gradient_checkpointing: bool = setting(False, "recompute the draft's layers in backward instead of storing "
                                                  "their activations")
    save_every: int = setting(100, "optimizer steps between checkpoints", ge=1)
    keep_last: int = setting(2, "checkpoints kept", ge=1)
    resume: str | None = setting(None, "continue a run: latest, or a checkpoint directory")
    log_every: int = setting(10, "optimizer steps between logged lines", ge=1)
    seed: int = setting(0, "the seed of initialization and data order")
    overwrite: bool = setting(False, "replace an earlier run in output_dir")
    require_servable: bool = setting(False, "an error, not a warning, when the installed vLLM cannot serve the "
                                            "draft")

    def validate(self) -> None:
        refused = getattr(get(self.algorithm), "REFUSED_DRAFT_KEYS", {})  # {key: why}: one line, before the schema
        for key in refused:
            if isinstance(self.draft, dict) and self.draft.get(key) is not None:
                raise ConfigError(refused[key])
        self.draft = load_section(get(self.algorithm).Config, self.draft, "draft")
        o = self.online
        vllm_only = o.devices or o.gpu_memory_utilization or o.target_dtype or max(
            o.tensor_parallel_size, o.pipeline_parallel_size) > 1
        if o.engine == "hf" and vllm_only:
            raise ConfigError("online.devices, gpu_memory_utilization, target_dtype and "
                              "tensor/pipeline_parallel_size are online.engine=vllm settings; the hf engine runs "
                              "in the trainer's dtype (float32 on the CPU, else bfloat16), placed by "
                              "online.producer_resources")
        if o.producer_resources and o.devices:
            raise ConfigError("online.devices names this machine's devices for vLLM producers started here; with "
                              "online.producer_resources Ray places them and gives each the devices it asks for "
                              "(e.g. {GPU: 2, producer_node: 1}): drop one of the two")
        if self.draft.aux_layer_ids is not None:
            check_layer_ids(self.draft.aux_layer_ids, "draft.aux_layer_ids")
