"""The `capture` stage's schema (recipes/capture.py): the target's hidden states over prepared data."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from trainer.data.shards import STORE_DTYPES
from trainer.drafts.registry import get
from trainer.drafts.shape import DEFAULT_DRAFT_VOCAB_SIZE
from trainer.errors import ConfigError
from trainer.layer_ids import check_layer_ids
from trainer.target import DEFAULT_TARGET, TARGET_DTYPES


@dataclass
class CaptureConfig:
    data: str = MISSING  # a `prepare` output directory
    output_dir: str = MISSING
    target: str = DEFAULT_TARGET
    # The algorithms this capture serves: with aux_layer_ids null it stores the sorted union of
    # their default layer ids, and each draft selects its own subset by id at training.
    drafts: list[str] = field(default_factory=lambda: ["eagle3"])
    # Entering-layer convention (id i = HF hidden_states[i]), strictly increasing; null: the drafts' defaults.
    aux_layer_ids: list[int] | None = None
    target_dtype: str = "float32"  # the dtype the target runs in
    # the dtype hidden states are stored in: float32 | bfloat16 | float16 | float8_e4m3 (a scale per
    # token and layer: half of bfloat16's bytes; trainer/data/shards.py)
    store_dtype: str = "bfloat16"
    # hf: the target in transformers, in each process (data parallel under accelerate launch); vllm: the
    # target served by vLLM (its own environment), its states written by draftsmith's KV connector
    # (trainer/vllm/runners/draftsmith_capture_connector.py): for targets beyond one device
    engine: str = "hf"
    tensor_parallel_size: int = 1  # vllm: devices per engine
    pipeline_parallel_size: int = 1  # vllm: pipeline stages per engine
    data_parallel_size: int = 1  # vllm: engines side by side, each on its own devices and share of the shards
    concurrency: int = 8  # vllm: sequences prefilled together (its max_num_seqs)
    estimate: bool = False  # print bytes/token, the disk the capture needs and the time it will take; capture nothing
    max_samples: int | None = None
    # tokens per sample: a longer prepared sample is skipped (never cut), counted in the manifest and said
    # in one line; null: the target's context (max_position_embeddings; states past it are not the target's)
    max_length: int | None = None
    samples_per_shard: int = 256
    max_tokens_per_batch: int = 4096  # padded tokens per forward
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE  # Vd: the top-Vd loss-masked tokens (EAGLE-3 uses 32000)
    resume: bool = True  # continue a partial capture of the same config in output_dir
    overwrite: bool = False
    seed: int = 0
    # Whether the vLLM you serve with can serve these drafts for this target (export/servable.py):
    # a warning at start by default; true makes it an error before any work.
    require_servable: bool = False

    def validate(self) -> None:
        if self.target_dtype not in TARGET_DTYPES:
            raise ConfigError(f"target_dtype={self.target_dtype!r}; use one of {', '.join(TARGET_DTYPES)}")
        if self.store_dtype not in STORE_DTYPES:
            raise ConfigError(f"store_dtype={self.store_dtype!r}; use one of {', '.join(STORE_DTYPES)}")
        if self.engine not in ("hf", "vllm"):
            raise ConfigError(f"engine={self.engine!r}; use hf (transformers) or vllm")
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size, self.concurrency) < 1:
            raise ConfigError("tensor_parallel_size, pipeline_parallel_size, data_parallel_size and concurrency must "
                              "be >= 1")
        if self.engine == "hf" and max(self.tensor_parallel_size, self.pipeline_parallel_size,
                                       self.data_parallel_size) > 1:
            raise ConfigError("tensor/pipeline/data_parallel_size are engine=vllm settings; with engine=hf, data "
                              "parallelism is `accelerate launch --num_processes N`")
        if self.samples_per_shard < 1 or self.max_tokens_per_batch < 1 or self.draft_vocab_size < 1:
            raise ConfigError("samples_per_shard, max_tokens_per_batch and draft_vocab_size must be >= 1")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length}; use >= 1, or null for the target's context")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"max_samples={self.max_samples}; use >= 1, or null for every prepared sample")
        if not self.drafts:
            raise ConfigError("drafts is empty; list the algorithms this capture is for, e.g. [eagle3]")
        for name in self.drafts:
            get(name)
        if self.aux_layer_ids is not None:
            check_layer_ids(self.aux_layer_ids, "aux_layer_ids")
