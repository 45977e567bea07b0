"""The `eval` stage's schema (recipes/eval.py): a draft measured by the in-tree decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError
from trainer.settings import setting
from trainer.speculative import DRAFT_SAMPLING


def checked_buckets(buckets: list[int], max_new_tokens: int) -> list[int]:
    """Context buckets sorted, once each; each must leave room for a prompt beside the answer
    (eval's and compare's rule)."""
    buckets = sorted(set(buckets))
    if buckets and buckets[0] <= max_new_tokens:
        raise ConfigError(f"context bucket {buckets[0]} leaves no room for a prompt beside "
                          f"max_new_tokens={max_new_tokens}; use buckets above it")
    return buckets


@dataclass
class EvalConfig:
    """`draftsmith eval`: a draft measured by the in-tree decoder against in-tree autoregressive decoding."""

    draft: str = setting("ngram", "the draft measured: ngram (prompt lookup, no training), a trained draft folder "
                                  "or an export")
    target: str | None = setting(None, "the target; null: the one the draft records (its sha256 checked), the "
                                       "default target for ngram")
    dataset: str = setting("gsm8k", "the prompts: gsm8k | math500 | humaneval | mtbench | sharegpt | jsonl:PATH")
    chat_template: str | None = setting(None, "the prompts' chat template (a Jinja file or text); null: the one "
                                              "the draft's data was prepared with, else the target's own")
    no_chat_template: bool = setting(False, "the prompt text as is, no chat template (base models)")
    num_prompts: int = setting(16, "prompts measured", ge=1)
    max_new_tokens: int = setting(128, "tokens generated per prompt", ge=1)
    num_draft_tokens: int | None = setting(None, "vLLM's num_speculative_tokens; null: for an export, the N it "
                                                 "records (its serve line's); for a trained draft, the positions it "
                                                 "was trained on (EAGLE-3's TTT steps, a DFlash block's K-1, a DSpark "
                                                 "block's K); 4 for the n-gram baseline", ge=1)
    temperature: float = setting(0.0, "the sampling temperature; 0 = greedy", ge=0)
    top_p: float = setting(1.0, "nucleus sampling's mass", gt=0, le=1)
    top_k: int = setting(0, "sampling's top-k; 0 = off", ge=0)
    draft_sampling: str = setting("greedy", "how the draft picks its tokens under sampling, vLLM's "
                                            "draft_sample_method (vllm/config/speculative.py): greedy (its default: "
                                            "argmax proposals, one-hot q in rejection sampling) or probabilistic "
                                            "(x ~ softmax(logits / temperature), q in the ratio test)",
                                  choices=DRAFT_SAMPLING)
    draft_options: dict[str, Any] = setting(help="keyword options of the algorithm's proposer (its OPTIONS, e.g. "
                                                 "DSpark's draft_topk)", factory=dict)
    ablations: list[str] = setting(help="variants the algorithm declares (its ABLATIONS, e.g. DSpark's "
                                        "without_markov), decoded and reported too", factory=list)
    batch_size: int = setting(1, "prompts decoded together", ge=1)
    context_buckets: list[int] = setting(help="τ per context length: context lengths L (e.g. [1024, 2048, 4096, "
                                              "8192]), each measured on its own num_prompts prompts of L - "
                                              "max_new_tokens tokens (documents followed by a question, from "
                                              "ShareGPT: trainer/data/buckets.py) instead of dataset's; [] = off",
                                         factory=list, ge=2)
    output_dir: str = setting("runs/eval", "where the report goes")
    seed: int = setting(0, "the sampling seed")
    overwrite: bool = setting(True, "a report folder is a measurement: re-running replaces it")

    def validate(self) -> None:
        self.context_buckets = checked_buckets(self.context_buckets, self.max_new_tokens)
        if self.no_chat_template and self.chat_template is not None:
            raise ConfigError(f"chat_template={self.chat_template} and no_chat_template=true ask for both a template "
                              "and none; drop one of them")


NGRAM_DRAFT_TOKENS = 4  # the n-gram baseline's N when none is given
