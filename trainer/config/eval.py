"""The `eval` stage's schema (recipes/eval.py): a draft measured by the in-tree decoder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.errors import ConfigError
from trainer.speculative import check_draft_sampling


@dataclass
class EvalConfig:
    """`draftsmith eval`: a draft measured by the in-tree decoder against in-tree autoregressive decoding."""

    draft: str = "ngram"  # "ngram" (prompt lookup, no training) or a trained draft folder
    # null: the target the draft records (its sha256 checked), the default target for ngram
    target: str | None = None
    dataset: str = "gsm8k"  # gsm8k | math500 | humaneval | mtbench | sharegpt | jsonl:PATH
    # The prompts' chat template (a Jinja file or text). null: the one the draft's data was
    # prepared with, else the target's own. no_chat_template: the prompt text as is (base models).
    chat_template: str | None = None
    no_chat_template: bool = False
    num_prompts: int = 16
    max_new_tokens: int = 128
    # vLLM's num_speculative_tokens. null: for an export, the N it records (its serve line's); for a
    # trained draft, the positions it was trained on (its Config.num_positions: EAGLE-3's TTT steps,
    # a DFlash block's K-1, a DSpark block's K); NGRAM_DRAFT_TOKENS for the n-gram baseline.
    num_draft_tokens: int | None = None
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    # How the draft picks its tokens under sampling, vLLM 0.32's `draft_sample_method`
    # (vllm/config/speculative.py): "greedy" (its default: argmax proposals, one-hot q in
    # rejection sampling) or "probabilistic" (x ~ softmax(logits / temperature), q in the ratio test).
    draft_sampling: str = "greedy"
    # Keyword options of the algorithm's proposer (its OPTIONS, e.g. DSpark's draft_topk), and
    # variants it declares (its ABLATIONS, e.g. DSpark's without_markov) decoded and reported too.
    draft_options: dict[str, Any] = field(default_factory=dict)
    ablations: list[str] = field(default_factory=list)
    batch_size: int = 1
    # τ per context length: context lengths L (e.g. [1024, 2048, 4096, 8192]), each measured on its own
    # num_prompts prompts of L - max_new_tokens tokens (documents followed by a question, from ShareGPT:
    # trainer/data/buckets.py) instead of `dataset`'s; [] = off
    context_buckets: list[int] = field(default_factory=list)
    output_dir: str = "runs/eval"
    seed: int = 0
    overwrite: bool = True  # a report folder is a measurement: re-running replaces it

    def validate(self) -> None:
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ConfigError("num_draft_tokens must be >= 1, or null for the N an export records (a trained draft: "
                              "the positions it was trained on)")
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ConfigError("num_prompts, max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("temperature must be >= 0, top_p in (0, 1], top_k >= 0")
        check_draft_sampling(self.draft_sampling)
        self.context_buckets = sorted(set(self.context_buckets))
        if self.context_buckets and min(self.context_buckets) <= self.max_new_tokens:
            raise ConfigError(f"context bucket {min(self.context_buckets)} leaves no room for a prompt beside "
                              f"max_new_tokens={self.max_new_tokens}; use buckets above it")
        if self.no_chat_template and self.chat_template is not None:
            raise ConfigError(f"chat_template={self.chat_template} and no_chat_template=true ask for both a template "
                              "and none; drop one of them")


NGRAM_DRAFT_TOKENS = 4  # the n-gram baseline's N when none is given
