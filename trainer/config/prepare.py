"""The `prepare` stage's schema (recipes/prepare.py): chat data -> token ids and loss masks,
with the target's own answers when regeneration is on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from trainer.errors import ConfigError
from trainer.target import DEFAULT_TARGET, TARGET_DTYPES

REGENERATE_ENGINES = ("hf", "vllm")


@dataclass
class RegenerateConfig:
    """Replace assistant turns with the target's own answers (drafts trained on the
    target's outputs accept more: EAGLE-3 paper, §4; SpecForge's regenerate step). Turn j of a
    conversation is generated after the target's answers to turns < j. An empty answer, an
    answer cut at max_new_tokens under truncated=drop, or a prompt longer than max_model_len
    ends its conversation at the last good answer (counted; a conversation left with none is
    skipped and counted)."""

    enabled: bool = False
    # hf: transformers' generate in this process (static batches of batch_size); vllm: the
    # target in vLLM (its own environment, scripts/setup_vllm.sh; continuous batching)
    engine: str = "hf"
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    truncated: str = "keep"  # an answer cut at max_new_tokens: keep it, or drop it (and the turns after it)
    max_model_len: int | None = None  # prompt + answer tokens; null: prepare's max_length (resolved)
    batch_size: int = 8  # hf: conversations per generate call
    concurrency: int = 32  # vllm: requests decoded together (its max_num_seqs; GPUs take hundreds)
    tensor_parallel_size: int = 1  # vllm: devices per engine (targets beyond one device)
    data_parallel_size: int = 1  # vllm: engines, each on its own devices and share of the conversations
    # the target's dtype in either engine: float32 (the precision draftsmith computes the target in on
    # a CPU; vLLM's "auto" would downcast a float32 checkpoint to bfloat16), or bfloat16 / float16 on GPUs
    dtype: str = "float32"
    prefix_caching: bool = False  # vllm: faster multi-turn, but a resumed run may then round differently


@dataclass
class PrepareConfig:
    output_dir: str = MISSING
    target: str = DEFAULT_TARGET  # embedded alias, HF dir or .gguf: its tokenizer and chat template are used
    # sharegpt | mtbench-chats | PATH.json | PATH.jsonl (ShareGPT or "messages" records), or a mixture:
    # a list of those or of {source: ..., weight: W} (0 < W <= 1: the fraction of its records taken),
    # deduplicated by the first user turn, counted per source in the summary
    source: Any = "sharegpt"
    max_records: int | None = None  # read at most this many records from the source
    # tokens; a longer conversation is skipped (reason too_long), counted and said in one line, never cut;
    # null: the target's context (max_position_embeddings in its config: SmolLM2's 8,192)
    max_length: int | None = None
    strict: bool = False  # stop at the first bad record instead of skipping it
    num_proc: int = 1  # datasets.map workers for tokenization
    chat_template: str | None = None  # a Jinja template to use instead of the target's
    seed: int = 0
    overwrite: bool = False
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    def validate(self) -> None:
        if self.max_length is not None and self.max_length < 8:
            raise ConfigError(f"max_length={self.max_length} is too small; use at least 8 tokens")
        if self.max_records is not None and self.max_records < 1:
            raise ConfigError("max_records must be >= 1 (or null for all records)")
        if self.num_proc < 1:
            raise ConfigError("num_proc must be >= 1")
        rg = self.regenerate
        if rg.temperature < 0 or not 0 < rg.top_p <= 1 or rg.top_k < 0:
            raise ConfigError("regenerate.temperature must be >= 0, regenerate.top_p in (0, 1], regenerate.top_k >= 0")
        if rg.engine not in REGENERATE_ENGINES:
            raise ConfigError(f"regenerate.engine '{rg.engine}' is not one of {', '.join(REGENERATE_ENGINES)}")
        if rg.truncated not in ("keep", "drop"):
            raise ConfigError(f"regenerate.truncated '{rg.truncated}' is not keep or drop")
        if min(rg.max_new_tokens, rg.batch_size, rg.concurrency, rg.tensor_parallel_size, rg.data_parallel_size) < 1:
            raise ConfigError("regenerate.max_new_tokens, batch_size, concurrency, tensor_parallel_size and "
                              "data_parallel_size must be >= 1")
        if rg.max_model_len is not None and rg.max_model_len <= rg.max_new_tokens:
            raise ConfigError(f"regenerate.max_model_len={rg.max_model_len} leaves no room for a prompt beside "
                              f"max_new_tokens={rg.max_new_tokens}; raise it or null for max_length")
        if rg.dtype not in TARGET_DTYPES:
            raise ConfigError(f"regenerate.dtype '{rg.dtype}' is not one of {', '.join(TARGET_DTYPES)}")
