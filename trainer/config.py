"""Typed run configs: dataclass defaults <- YAML file <- `key=value` overrides.

One dataclass schema per recipe (see `SCHEMAS`). OmegaConf structured configs do
the merging and type checks; this module turns their exceptions into one line
that names the key and says how to fix it: unknown keys get a "did you mean"
suggestion, wrong types name the expected type, missing required fields are
listed. Cross-field checks live in each schema's `validate()` method and run at
load time.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError

__all__ = ["MISSING", "load_config", "to_yaml", "ConfigError"]

T = TypeVar("T")


def _field_types(schema: type) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(schema)}


def _nested_schema(f: dataclasses.Field) -> type | None:
    t = f.type
    if isinstance(t, str):  # postponed annotations: resolve through the default
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        return type(default) if dataclasses.is_dataclass(default) else None
    return t if dataclasses.is_dataclass(t) else None


def _check_keys(schema: type, data: Any, where: str, prefix: str = "") -> None:
    """Reject keys the schema does not have, with the closest valid key as a hint."""
    if not isinstance(data, dict):
        return
    fields = _field_types(schema)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{where}: unknown key '{full}' for {schema.__name__}{hint}")
        sub = _nested_schema(fields[key])
        if sub is not None:
            _check_keys(sub, value, where, prefix=f"{full}.")


def _field_type(schema: type, dotted: str) -> str | None:
    """The annotation (as written) of a dotted key of `schema`, None where it is not a
    dataclass field (a free-form section such as train.draft)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        f = _field_types(schema).get(part) if dataclasses.is_dataclass(schema) else None
        if f is None:
            return None
        if i == len(parts) - 1:
            return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        schema = _nested_schema(f)
    return None


def _parse_overrides(overrides: list[str], schema: type) -> dict:
    """`key=value` items -> a nested dict. Values are YAML (numbers, booleans, lists), except
    for string fields, which take the text as it is (a Jinja template, a path with brackets,
    "true"); `null` still unsets an optional string. A value that is not YAML for a field
    that is not a string is one line naming the key."""
    import yaml

    out: dict = {}
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not key=value (e.g. batch_size=8 or capture.dtype=bf16)")
        key, raw = item.split("=", 1)
        kind = _field_type(schema, key)
        if kind in ("str", "str | None"):
            value = None if kind == "str | None" and raw in ("null", "~", "None") else raw
        elif kind == "Any":  # a string or a structure (prepare's source: a path or a mixture list)
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError as err:
                first = str(err).splitlines()[0]
                raise ConfigError(f"override '{key}': value {raw!r} is not valid YAML ({first}); quote it or fix "
                                  "its syntax") from None
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{key}' conflicts with another override of '{part}'")
        node[last] = value
    return out


def _merge(base: DictConfig, data: dict, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, data)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"{where}: key '{key}': {msg}") from None


def check_finite(obj: Any, prefix: str = "") -> None:
    """Every float field of a config (nested ones too) is a finite number: NaN passes every
    comparison a bound makes (`x < 0` is False), and inf is never a setting. One line naming the key."""
    import math

    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name}={value} is not a finite number; give a real value")
        check_finite(value, f"{prefix}{f.name}.")


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build a `schema` instance from its defaults, an optional YAML file and overrides."""
    cfg: DictConfig = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found; pass an existing YAML (see recipes/configs/)")
        try:
            data = OmegaConf.to_container(OmegaConf.load(path)) or {}
        except Exception as err:  # yaml.YAMLError and friends
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"config file '{path}' is not valid YAML: {first}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
        _check_keys(schema, data, str(path))
        cfg = _merge(cfg, data, str(path))
    if overrides:
        data = _parse_overrides(overrides, schema)
        _check_keys(schema, data, "override")
        cfg = _merge(cfg, data, "override")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        where = f" in '{path}'" if path is not None else ""
        raise ConfigError(
            f"required key(s) {', '.join(missing)} not set{where}; set them in the YAML or as key=value overrides"
        )
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{getattr(err, 'full_key', '?')}: {getattr(err, 'msg', err)}") from None
    check_finite(obj)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj  # type: ignore[return-value]


def load_section(schema: type[T], data: Any, where: str) -> T:
    """A config section whose schema is chosen at load time (a draft's config, picked by
    `algorithm` through the registry): the same strict keys, types and `validate()`."""
    if dataclasses.is_dataclass(data):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(f"'{where}' must be a mapping of keys, not {type(data).__name__}")
    _check_keys(schema, data, "config", prefix=f"{where}.")
    cfg = _merge(OmegaConf.structured(schema), data, where)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where}.{getattr(err, 'full_key', '?')}: {getattr(err, 'msg', err)}") from None
    check_finite(obj, f"{where}.")
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (written beside every stage's output)."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))


# ---------------------------------------------------------------------------
# Schemas: one per recipe. Every default lives here, once.
# ---------------------------------------------------------------------------
from dataclasses import dataclass, field  # noqa: E402

from trainer.drafts.shape import DEFAULT_DRAFT_VOCAB_SIZE  # noqa: E402
from trainer.layer_ids import check_layer_ids  # noqa: E402
from trainer.target import DEFAULT_TARGET  # noqa: E402

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


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
    max_model_len: int | None = None  # prompt + answer tokens; null: prepare's max_length
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
    max_length: int = 2048  # tokens; longer conversations are skipped (reason too_long)
    strict: bool = False  # stop at the first bad record instead of skipping it
    num_proc: int = 1  # datasets.map workers for tokenization
    chat_template: str | None = None  # a Jinja template to use instead of the target's
    seed: int = 0
    overwrite: bool = False
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    def validate(self) -> None:
        if self.max_length < 8:
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
        if rg.dtype not in _DTYPE_NAMES:
            raise ConfigError(f"regenerate.dtype '{rg.dtype}' is not one of {', '.join(_DTYPE_NAMES)}")


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
    # (export/runners/draftsmith_capture_connector.py): for targets beyond one device
    engine: str = "hf"
    tensor_parallel_size: int = 1  # vllm: devices per engine
    pipeline_parallel_size: int = 1  # vllm: pipeline stages per engine
    data_parallel_size: int = 1  # vllm: engines side by side, each on its own devices and share of the shards
    concurrency: int = 8  # vllm: sequences prefilled together (its max_num_seqs)
    estimate: bool = False  # print bytes/token, the disk the capture needs and the time it will take; capture nothing
    max_samples: int | None = None
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
        from trainer.data.shards import STORE_DTYPES

        if self.target_dtype not in _DTYPE_NAMES:
            raise ConfigError(f"target_dtype={self.target_dtype!r}; use one of {', '.join(_DTYPE_NAMES)}")
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
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"max_samples={self.max_samples}; use >= 1, or null for every prepared sample")
        from trainer.drafts import get

        if not self.drafts:
            raise ConfigError("drafts is empty; list the algorithms this capture is for, e.g. [eagle3]")
        for name in self.drafts:
            get(name)
        if self.aux_layer_ids is not None:
            check_layer_ids(self.aux_layer_ids, "aux_layer_ids")


@dataclass
class TrainConfig:
    """`recipes/train.py`: a draft trained on a capture (offline) or on the target in the loop (online)."""

    data: str = MISSING  # a capture dir (offline), or a prepared-data dir with online=true
    output_dir: str = MISSING
    algorithm: str = "eagle3"  # a key of trainer.drafts.DRAFTS
    target: str = DEFAULT_TARGET
    online: bool = False  # hidden states from the target in the loop instead of a capture
    # The draft's shape and objective: the `Config` of the chosen algorithm's module
    # (trainer/drafts/<algorithm>.py), checked against that schema at load time.
    draft: dict[str, Any] = field(default_factory=dict)
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; caps epochs
    max_samples: int | None = None  # train on the first N samples of the data only (a data budget); null: all
    batch_size: int = 1  # samples per process per micro-batch
    gradient_accumulation_steps: int = 1
    max_length: int = 2048  # samples are truncated to this many tokens
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 0.5
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
        from trainer.drafts import get

        self.draft = load_section(get(self.algorithm).Config, self.draft, "draft")
        if self.draft.aux_layer_ids is not None:
            check_layer_ids(self.draft.aux_layer_ids, "draft.aux_layer_ids")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ConfigError(f"mixed_precision={self.mixed_precision!r}; use auto, no, bf16 or fp16")
        for key in ("epochs", "batch_size", "gradient_accumulation_steps", "save_every", "keep_last",
                    "log_every", "max_length"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps}; use >= 1, or null to train `epochs` full epochs")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"max_samples={self.max_samples}; use >= 1, or null for every sample of the data")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ConfigError("learning_rate must be > 0, warmup_steps and max_grad_norm >= 0")


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
    # vLLM's num_speculative_tokens. null: the positions the draft was trained on (its
    # Config.num_positions: EAGLE-3's TTT steps, a DFlash block's B-1, a DSpark block's B);
    # NGRAM_DRAFT_TOKENS for the n-gram baseline.
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
    output_dir: str = "runs/eval"
    seed: int = 0
    overwrite: bool = True  # a report folder is a measurement: re-running replaces it

    def validate(self) -> None:
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ConfigError("num_draft_tokens must be >= 1, or null for the positions the draft was trained on")
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ConfigError("num_prompts, max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("temperature must be >= 0, top_p in (0, 1], top_k >= 0")
        from trainer.speculative import check_draft_sampling

        check_draft_sampling(self.draft_sampling)


NGRAM_DRAFT_TOKENS = 4  # the n-gram baseline's N when none is given


@dataclass
class ExportConfig:
    """`draftsmith export`: a trained draft -> a folder vLLM loads (BF16, or FP8 via AMD Quark)."""

    draft: str = MISSING  # a recipes/train.py output_dir
    output_dir: str = MISSING
    target: str | None = None  # null: the target the draft records (it must be the one it was trained on)
    format: str = "vllm"  # the algorithm's exporter says which it writes (EAGLE-3: vllm | speculators)
    dtype: str = "bfloat16"  # of the unquantized tensors: bfloat16 | float16 | float32
    quantize: str = "none"  # none | fp8
    fp8_scheme: str = "ptpc_fp8"  # per-channel FP8 weights + dynamic per-token FP8 activations
    quantize_fc: bool = False  # AMD's shipped FP8 drafts keep fc in BF16
    quantize_qkv: bool = True  # q/k/v FP8 (false: BF16, all layers; see scripts/compare_drafts.py for the measured gate)
    # N written into the serve command (and speculators_config, and the FP8 gate). null: the
    # positions the draft was trained on (Config.num_positions).
    num_draft_tokens: int | None = None
    # Proposer options the export serves with (written where vLLM reads them, e.g. DSpark's
    # draft_topk as dspark_draft_topk); the FP8 gate decodes with them too.
    draft_options: dict[str, Any] = field(default_factory=dict)
    # FP8 acceptance gate: τ of the FP8 draft vs its BF16 source, in-tree, greedy, held-out prompts.
    gate: bool = True
    gate_dataset: str = "mtbench"  # not a training source: held out
    gate_prompts: int = 8
    gate_max_new_tokens: int = 64
    max_tau_drop: float = 0.05  # relative: fail when tau_fp8 < (1 - max_tau_drop) * tau_bf16
    # The gate prompts' chat template, as for eval: null = the draft's data template, else the target's.
    chat_template: str | None = None
    no_chat_template: bool = False
    overwrite: bool = False
    require_servable: bool = False  # as capture's: an error, not a warning, when vLLM cannot serve the draft

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype '{self.dtype}' is not one of bfloat16, float16, float32")
        if self.quantize not in ("none", "fp8"):
            raise ConfigError(f"quantize '{self.quantize}' is not one of none, fp8")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ConfigError("num_draft_tokens must be >= 1, or null for the positions the draft was trained on")
        if self.gate_prompts < 1 or self.gate_max_new_tokens < 1:
            raise ConfigError("gate_prompts and gate_max_new_tokens must be >= 1")
        if not 0 <= self.max_tau_drop < 1:
            raise ConfigError("max_tau_drop is a fraction of the BF16 τ in [0, 1)")


@dataclass
class DemoConfig:
    """The whole pipeline on the embedded target: prepare -> capture -> train EAGLE-3 ->
    export BF16 and FP8 -> evaluate both. `target` applies to every stage."""

    output_dir: str = "runs/demo"
    target: str = DEFAULT_TARGET
    algorithm: str = "eagle3"  # the draft trained, exported and evaluated (a key of trainer.drafts.DRAFTS)
    overwrite: bool = False  # replace an earlier demo's output_dir
    prepare: PrepareConfig = field(default_factory=lambda: PrepareConfig(output_dir="(set by the demo)"))
    capture: CaptureConfig = field(
        default_factory=lambda: CaptureConfig(data="(set by the demo)", output_dir="(set by the demo)")
    )
    train: TrainConfig = field(default_factory=lambda: TrainConfig(data="(set by the demo)",
                                                                   output_dir="(set by the demo)"))
    # The draft section (train.draft) per algorithm, so that `algorithm=` alone switches the demo.
    draft_by_algorithm: dict[str, Any] = field(default_factory=dict)
    # for export (the serve command), the FP8 gate and the evaluation; null: the positions the
    # draft is trained on (EAGLE-3's TTT steps, a DFlash block's B-1, a DSpark block's B)
    num_draft_tokens: int | None = None
    eval_dataset: str = "mtbench"  # held out from training (ShareGPT)
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    gate_prompts: int = 4
    quantize_fc: bool = False

    def validate(self) -> None:
        from trainer.drafts import get

        get(self.algorithm)
        self.train.algorithm = self.algorithm
        given = dataclasses.asdict(self.train.draft) if dataclasses.is_dataclass(self.train.draft) else self.train.draft
        self.train.draft = {**self.draft_by_algorithm.get(self.algorithm, {}), **given}  # train.draft.* wins
        if self.algorithm not in self.capture.drafts:
            self.capture.drafts = [*self.capture.drafts, self.algorithm]
        self.prepare.validate()
        self.capture.validate()
        self.train.validate()
        if (self.num_draft_tokens is not None and self.num_draft_tokens < 1) or self.eval_prompts < 1 \
                or self.gate_prompts < 1:
            raise ConfigError("num_draft_tokens (or null), eval_prompts and gate_prompts must be >= 1")


def _schemas() -> dict[str, type]:
    """YAML file stem -> schema (recipes/configs/*/<stem>.yaml); a draft's training config is named after it."""
    from trainer.drafts import DRAFTS

    return {"export": ExportConfig, "prepare": PrepareConfig, "eval": EvalConfig, "capture": CaptureConfig,
            "demo": DemoConfig, **{name: TrainConfig for name in DRAFTS}}


SCHEMAS = _schemas()
