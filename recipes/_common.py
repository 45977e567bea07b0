"""What every recipe's `main` shares: `--config FILE key=value ...` parsing and the
one-line error contract (a `DraftsmithError` prints one line and exits 2)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import json
import sys
import types
import typing
from pathlib import Path

from omegaconf import MISSING
from tqdm import tqdm as std_tqdm
from tqdm.auto import tqdm

from export import formats
from trainer.config import NGRAM_DRAFT_TOKENS, load_config
from trainer.data.chat import resolve_template, template_file
from trainer.data.evalsets import chat_prompt_ids
from trainer.drafts.folder import load_draft
from trainer.drafts.registry import get
from trainer.errors import DraftsmithError
from trainer.target import DEFAULT_TARGET

CONFIG_HELP = "a YAML under recipes/configs/ (optional: the schema's defaults and key=value overrides work too)"
OVERRIDES_HELP = "key=value overrides of any config field, e.g. output_dir=runs/x max_length=1024 (they win)"


def _parser(description: str, prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    return parser


def parse_args(schema, argv: list[str] | None, description: str, prog: str | None = None):
    parser = _parser(description, prog)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    args = parser.parse_args(argv)
    return load_config(schema, args.config, args.overrides)


def _default(schema, key: str):
    for f in dataclasses.fields(schema):
        if f.name == key:
            if f.default is not dataclasses.MISSING:
                return f.default
            return None if f.default_factory is dataclasses.MISSING else f.default_factory()
    return None


def parse_flags(schema, argv: list[str], description: str, flags: dict[str, tuple[str, str]],
                switches: dict[str, tuple[str, str]] | None = None, prog: str | None = None,
                repeated: dict[str, tuple[str, str, str]] | None = None):
    """`--config FILE`, `--flag VALUE` for each of `flags` (flag -> (config key, help)), boolean
    `switches` (flag -> ("key=value" it sets, help)), `repeated` flags (flag -> (key of a dict
    or list field, metavar, help): `--flag K=V` sets key.K for a dict, `--flag X` appends X to
    a list), then `key=value` overrides, which win."""
    switches, repeated = switches or {}, repeated or {}
    parser = _parser(description, prog)
    for flag, (key, metavar, text) in repeated.items():
        parser.add_argument(flag, metavar=metavar, action="append", help=f"{text} (config key {key})")
    for flag, (key, text) in flags.items():
        default = _default(schema, key)
        shown = "required" if default == MISSING else f"default {default}"
        parser.add_argument(flag, metavar=key.upper(), help=f"{text} (config key {key}; {shown})")
    for flag, (_kv, text) in switches.items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    args = vars(parser.parse_args(argv))
    dest = lambda flag: flag[2:].replace("-", "_")  # noqa: E731
    overrides = [f"{key}={args[dest(flag)]}" for flag, (key, _) in flags.items() if args[dest(flag)] is not None]
    overrides += [kv for flag, (kv, _) in switches.items() if args[dest(flag)]]
    for flag, (key, _, _) in repeated.items():
        values = args[dest(flag)] or []
        if isinstance(_default(schema, key), dict):
            bad = [v for v in values if "=" not in v or v.startswith("=")]
            if bad:
                raise DraftsmithError(f"{flag} {bad[0]!r} is not KEY=VALUE (e.g. {flag} draft_topk=64)")
            overrides += [f"{key}.{v}" for v in values]
        elif values:
            overrides.append(f"{key}=[{','.join(values)}]")
    return load_config(schema, args["config"], overrides + args["overrides"])


def one_line_errors(fn):
    """Run `fn`; a DraftsmithError becomes `error: <message>` on stderr and exit status 2, and so
    does a full disk (whatever wrote to it); Ctrl-C is one line too (exit 130). Each is the last
    line printed: a progress bar is ended first."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DraftsmithError as err:
            _last_line(f"error: {err}")
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            _last_line("error: interrupted; nothing half-written was published (a training run continues from its "
                       "last checkpoint with resume=latest, a capture from its last shard with the same command)")
            raise SystemExit(130) from None
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            _last_line(f"error: no space left on the device writing '{err.filename or 'an output'}'; nothing "
                       "half-written was published and what was finished is kept (checkpoints, complete shards): "
                       "free space and run the same command again (resume=latest continues a training run)")
            raise SystemExit(2) from None

    return wrapper


def _last_line(text: str) -> None:
    """`text` on stderr on a line of its own, below any progress bar (tqdm's are closed first)."""
    for cls in (std_tqdm, tqdm):
        for bar in list(getattr(cls, "_instances", ())):
            bar.close()
    sys.stderr.flush()
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def load_proposer(path: str, target, draft_sampling: str = "greedy", seed: int = 0, **options):
    """A trained draft folder or an export (BF16, or FP8 simulated) -> (its in-tree proposer,
    a description), through the draft registry. `options` go to the algorithm's Proposer and
    must be among its OPTIONS (DSpark: markov, draft_topk). An export proposes as vLLM serves
    it: the options it wrote into its config.json (recorded in its manifest) apply unless
    `options` names them."""
    if not Path(path).is_dir():
        raise DraftsmithError(f"draft '{path}' is neither 'ngram', a trained draft folder nor an export")
    if (Path(path) / formats.EXPORT_MANIFEST).is_file():
        manifest = json.loads((Path(path) / formats.EXPORT_MANIFEST).read_text())
        kind = f"FP8 {manifest['quantization']['scheme']}" if manifest.get("quantization") else manifest["dtype"]
        algorithm, draft = formats.load_export(path, target)
        name = f"{algorithm} {kind} ({path})"
        served = {k: v for k, v in (manifest.get("draft_options") or {}).items() if v is not None}
        options = {**served, **options}
        if served:
            name += " with " + ", ".join(f"{k}={v}" for k, v in served.items())
        served_n = manifest.get("num_draft_tokens")  # the N its serve command names: its default N
    else:
        algorithm, draft = load_draft(path, target)
        name = f"{algorithm} ({path})"
        served_n = None
    proposer = get(algorithm).Proposer
    options = check_options(proposer, options, f"{algorithm} drafts ('{path}')")
    made = proposer(draft, draft_sampling=draft_sampling, seed=seed, **options)
    made.num_positions = draft.config.num_positions  # what it was trained on: a trained draft's default N
    made.served_num_draft_tokens = served_n if isinstance(served_n, int) and served_n >= 1 else None
    made.options = options  # what it proposes with (an export's served options included)
    return made, name


def _fits(value, expected) -> bool:
    """`value` is of the annotated type `expected` (bool a real bool, int an integer that is
    not a bool, float any such number; a union: any of its members); other types: not checked."""
    if isinstance(expected, types.UnionType) or typing.get_origin(expected) is typing.Union:
        return any(_fits(value, t) for t in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    return True


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _type_name(expected) -> str:
    if isinstance(expected, types.UnionType) or typing.get_origin(expected) is typing.Union:
        return " or ".join(_type_name(t) for t in typing.get_args(expected))
    return _TYPE_NAMES.get(expected, getattr(expected, "__name__", str(expected)))


def check_options(proposer, options: dict, what: str) -> dict:
    """Proposer options must be ones the algorithm declares (its OPTIONS), each of the type its
    Proposer's __init__ annotates (a bool: true or false, also as the strings a quoted YAML value
    gives; an int: an integer, never a bool). Returns the options, such strings made bools."""
    unknown = sorted(set(options) - set(proposer.OPTIONS))
    if unknown:
        raise DraftsmithError(f"{', '.join(unknown)}: not an option of {what}; they take "
                              f"{', '.join(proposer.OPTIONS) or 'none'}")
    hints = typing.get_type_hints(proposer.__init__)
    checked = {}
    for key, value in options.items():
        expected = hints.get(key)
        if isinstance(value, str) and value.lower() in ("true", "false") and expected is not None \
                and _fits(True, expected) and not _fits(value, expected):
            value = value.lower() == "true"
        if expected is not None and not _fits(value, expected):
            raise DraftsmithError(f"draft option {key}={value!r} is not {_type_name(expected)} (what {what} take "
                                  f"for {key}); pass e.g. --draft-option {key}={_example(expected)}")
        checked[key] = value
    return checked


def _example(expected) -> str:
    members = [t for t in typing.get_args(expected) if t is not type(None)] or [expected]
    return {bool: "false", int: "64", float: "0.5"}.get(members[0], "VALUE")


def default_num_draft_tokens(n: int | None, proposer) -> int:
    """N as given, else an export's recorded N (what its serve command serves), else the
    positions the draft was trained on (its Config.num_positions: serve the block you trained),
    else the n-gram baseline's."""
    if n is not None:
        return n
    return (getattr(proposer, "served_num_draft_tokens", None) or getattr(proposer, "num_positions", None)
            or NGRAM_DRAFT_TOKENS)


def draft_record(path: str) -> tuple[dict | None, dict]:
    """(the target record, the data record) a trained draft folder or an export carries: what
    it was trained for and on (the data's chat template among it); (None, {}) for 'ngram'."""
    p = Path(path)
    for name in (formats.EXPORT_MANIFEST, "config.json"):
        f = p / name
        if f.is_file():
            try:
                record = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError):
                return None, {}  # the stage that reads it says so, in one line
            if isinstance(record, dict) and isinstance(record.get("target"), dict):
                return record["target"], record.get("data") or {}
    return None, {}


def target_for(draft: str, given: str | None) -> str:
    """The target a stage loads for `draft`: `given` (--target overrides), else the one the draft
    records (the name it was loaded by: an embedded alias, an HF folder or a .gguf; its sha256 is
    checked when the draft is loaded), else the default target."""
    if given:
        return given
    record, _ = draft_record(draft) if draft != "ngram" else (None, {})
    if not record:
        return DEFAULT_TARGET
    return record.get("spec") or record.get("path") or record.get("hf_dir") or DEFAULT_TARGET


def prompt_ids(target, texts: list[str], draft: str, chat_template: str | None, plain: bool, where: str):
    """Eval prompts as token ids: each text as one user turn in the chat template (given as
    `chat_template` (text or file), else the one the draft's data was prepared with, else the
    target's own), or with `plain` the text as it is (base-model completion prompts)."""
    stage = where.split(" ", 1)[0]
    trained = draft_record(draft)[1].get("chat_template") if draft != "ngram" else None
    if plain:
        if getattr(target.tokenizer, "chat_template", None) or trained:
            whose = f"target {target.name} has a chat template" if getattr(target.tokenizer, "chat_template", None) \
                else "the draft was trained with a chat template"
            print(f"warning: {stage}: --no-chat-template on a chat model ({whose}): the prompts go in as plain text, "
                  "not as a chat server formats them, so what is measured may not be what it serves", file=sys.stderr)
        return chat_prompt_ids(target.tokenizer, texts, plain=True)
    template = resolve_template(target.tokenizer, chat_template or trained, where, f"target {target.name}")
    if chat_template and trained and template != trained:
        print(f"warning: {stage}: --chat-template {chat_template if template_file(chat_template) else '(given text)'} "
              "is not the chat template the draft was trained with (the one its data was prepared with): its "
              "acceptance on these prompts may not be what it gets where served with its own", file=sys.stderr)
    return chat_prompt_ids(target.tokenizer, texts, template)


def prompt_encoder(target, draft: str, chat_template: str | None, plain: bool, where: str):
    """`prompt_ids` as a function of the texts (what a prompt builder measures its prompts with:
    trainer/data/buckets.py), its template resolved and its warnings said once, here."""
    prompt_ids(target, [], draft, chat_template, plain, where)  # the warnings, once
    trained = draft_record(draft)[1].get("chat_template") if draft != "ngram" else None
    template = None if plain else resolve_template(target.tokenizer, chat_template or trained, where,
                                                   f"target {target.name}")
    return lambda texts: chat_prompt_ids(target.tokenizer, texts, template, plain)
