"""The `capture` stage's schema (recipes/capture.py): the target's hidden states over prepared data."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.data.shards import STORE_DTYPES
from trainer.drafts.registry import get
from trainer.drafts.shape import DEFAULT_DRAFT_VOCAB_SIZE
from trainer.errors import ConfigError
from trainer.layer_ids import check_layer_ids
from trainer.settings import setting
from trainer.target import DEFAULT_TARGET, TARGET_DTYPES


@dataclass
class CaptureConfig:
    data: str = setting(help="the prepare output folder captured")
    output_dir: str = setting(help="the capture folder written")
    target: str = setting(DEFAULT_TARGET, "the target: an embedded alias, an HF model folder or a .gguf file")
    drafts: list[str] = setting(help="the algorithms this capture serves: with aux_layer_ids null it stores the "
                                     "sorted union of their default layer ids, and each draft selects its own subset "
                                     "by id at training", factory=lambda: ["eagle3"])
    aux_layer_ids: list[int] | None = setting(None, "the layers stored, entering-layer convention (id i = HF "
                                                    "hidden_states[i]), strictly increasing; null: the drafts' "
                                                    "defaults")
    target_dtype: str = setting("float32", "the dtype the target runs in", choices=TARGET_DTYPES)
    store_dtype: str = setting("bfloat16", "the dtype hidden states are stored in (float8_e4m3: a scale per token "
                                           "and layer, half of bfloat16's bytes; trainer/data/shards.py)",
                               choices=STORE_DTYPES)
    engine: str = setting("hf", "the engine: hf, the target in transformers in each process (data parallel under "
                                "accelerate launch); vllm, the target served by vLLM (its own environment), its "
                                "states written by draftsmith's KV connector: for targets beyond one device",
                          choices=("hf", "vllm"))
    tensor_parallel_size: int = setting(1, "vllm: devices per engine", ge=1)
    pipeline_parallel_size: int = setting(1, "vllm: pipeline stages per engine", ge=1)
    data_parallel_size: int = setting(1, "vllm: engines side by side, each on its own devices and share of the "
                                         "shards", ge=1)
    concurrency: int = setting(8, "vllm: sequences prefilled together (its max_num_seqs)", ge=1)
    estimate: bool = setting(False, "print bytes/token, the disk the capture needs and the time it will take; "
                                    "capture nothing")
    max_samples: int | None = setting(None, "prepared samples captured at most; null: all", ge=1)
    max_length: int | None = setting(None, "tokens per sample at most; a longer prepared sample is skipped (never "
                                           "cut), counted in the manifest and said in one line; null: the target's "
                                           "context (states past it are not the target's)", ge=1)
    samples_per_shard: int = setting(256, "samples per shard file", ge=1)
    max_tokens_per_batch: int = setting(4096, "padded tokens per target forward", ge=1)
    draft_vocab_size: int = setting(DEFAULT_DRAFT_VOCAB_SIZE, "the draft vocabulary: the top loss-masked tokens "
                                                              "(EAGLE-3 uses 32000)", ge=1)
    resume: bool = setting(True, "continue a partial capture of the same config in output_dir")
    overwrite: bool = setting(False, "replace an earlier capture in output_dir")
    seed: int = setting(0, "the seed")
    require_servable: bool = setting(False, "whether the vLLM you serve with can serve these drafts for this "
                                            "target: a warning at start by default; true makes it an error before "
                                            "any work")

    def validate(self) -> None:
        if self.engine == "hf" and max(self.tensor_parallel_size, self.pipeline_parallel_size,
                                       self.data_parallel_size) > 1:
            raise ConfigError("tensor/pipeline/data_parallel_size are engine=vllm settings; with engine=hf, data "
                              "parallelism is `accelerate launch --num_processes N`")
        if not self.drafts:
            raise ConfigError("drafts is empty; list the algorithms this capture is for, e.g. [eagle3]")
        for name in self.drafts:
            get(name)
        if self.aux_layer_ids is not None:
            check_layer_ids(self.aux_layer_ids, "aux_layer_ids")
