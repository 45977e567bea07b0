"""The `prepare` stage's schema (recipes/prepare.py): chat data -> token ids and loss masks,
with the target's own answers when regeneration is on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError
from trainer.settings import setting
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

    enabled: bool = setting(False, "replace every answer with the target's own, turn by turn")
    engine: str = setting("hf", "the engine: hf, transformers' generate in this process (static batches of "
                                "batch_size); vllm, the target in vLLM (its own environment, scripts/setup_vllm.sh; "
                                "continuous batching)", choices=REGENERATE_ENGINES)
    max_new_tokens: int = setting(256, "tokens per answer at most", ge=1)
    temperature: float = setting(0.0, "the sampling temperature; 0 = greedy", ge=0)
    top_p: float = setting(1.0, "nucleus sampling's mass", gt=0, le=1)
    top_k: int = setting(0, "sampling's top-k; 0 = off", ge=0)
    truncated: str = setting("keep", "an answer cut at max_new_tokens: keep it, or drop it (and the turns after it)",
                             choices=("keep", "drop"))
    max_model_len: int | None = setting(None, "prompt + answer tokens at most; null: prepare's max_length "
                                              "(resolved)", ge=2)
    batch_size: int = setting(8, "hf: conversations per generate call", ge=1)
    concurrency: int = setting(32, "vllm: requests decoded together (its max_num_seqs; GPUs take hundreds)", ge=1)
    tensor_parallel_size: int = setting(1, "vllm: devices per engine (targets beyond one device)", ge=1)
    data_parallel_size: int = setting(1, "vllm: engines, each on its own devices and share of the conversations",
                                      ge=1)
    dtype: str = setting("float32", "the target's dtype in either engine: float32 (the precision draftsmith "
                                    "computes the target in on a CPU; vLLM's auto would downcast a float32 checkpoint "
                                    "to bfloat16), or bfloat16 / float16 on GPUs", choices=TARGET_DTYPES)
    prefix_caching: bool = setting(False, "vllm: faster multi-turn, but a resumed run may then round differently")


@dataclass
class PrepareConfig:
    output_dir: str = setting(help="the prepared folder written")
    target: str = setting(DEFAULT_TARGET, "the target (an embedded alias, an HF folder or a .gguf): its tokenizer "
                                          "and chat template are used")
    source: Any = setting("sharegpt", "the chats: sharegpt | mtbench-chats | PATH.json | PATH.jsonl (ShareGPT or "
                                      "messages records), or a mixture: a list of those or of {source: ..., weight: "
                                      "W} (0 < W <= 1: the fraction of its records taken), deduplicated by the first "
                                      "user turn, counted per source in the summary")
    max_records: int | None = setting(None, "records read from the source at most; null: all", ge=1)
    max_length: int | None = setting(None, "tokens per conversation at most; a longer one is skipped (reason "
                                           "too_long), counted and said in one line, never cut; null: the target's "
                                           "context (max_position_embeddings in its config: SmolLM2's 8,192)", ge=8)
    strict: bool = setting(False, "stop at the first bad record instead of skipping it")
    num_proc: int = setting(1, "datasets.map workers for tokenization", ge=1)
    chat_template: str | None = setting(None, "a Jinja template to use instead of the target's")
    seed: int = setting(0, "the seed of the mixture's draws and of sampled regeneration")
    overwrite: bool = setting(False, "replace an earlier prepared folder in output_dir")
    regenerate: RegenerateConfig = setting(help="regeneration: the target's own answers", factory=RegenerateConfig)

    def validate(self) -> None:
        rg = self.regenerate
        if rg.max_model_len is not None and rg.max_model_len <= rg.max_new_tokens:
            raise ConfigError(f"regenerate.max_model_len={rg.max_model_len} leaves no room for a prompt beside "
                              f"max_new_tokens={rg.max_new_tokens}; raise it or null for max_length")
