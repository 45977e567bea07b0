"""What every recipe's `main` shares: `--config FILE key=value ...` parsing and the
one-line error contract (a `DraftsmithError` prints one line and exits 2)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import json
import sys
from pathlib import Path

from omegaconf import MISSING
from tqdm import tqdm as std_tqdm
from tqdm.auto import tqdm

from export import formats
from trainer.config import NGRAM_DRAFT_TOKENS, load_config
from trainer.data.chat import resolve_template, template_file
from trainer.data.evalsets import chat_prompt_ids
from trainer.errors import DraftsmithError
from trainer.settings import help_of
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


def parse_flags(schema, argv: list[str], description: str, flags: tuple[str, ...],
                switches: dict[str, str] | None = None, prog: str | None = None,
                repeated: dict[str, tuple[str, str]] | None = None):
    """`--config FILE`, then `--key-name VALUE` for each config key in `flags`, boolean `switches`
    (flag -> the "key=value" it sets), `repeated` flags (flag -> (key of a dict or list field,
    metavar): `--flag K=V` sets key.K for a dict, `--flag X` appends X to a list), then `key=value`
    overrides, which win. Every flag's help is its setting's own (trainer/settings.py)."""
    switches, repeated = switches or {}, repeated or {}
    parser = _parser(description, prog)
    for flag, (key, metavar) in repeated.items():
        parser.add_argument(flag, metavar=metavar, action="append",
                            help=f"{help_of(schema, key)} (config key {key}; repeatable)")
    for key in flags:
        default = _default(schema, key)
        shown = "required" if default == MISSING else f"default {default}"
        parser.add_argument("--" + key.replace("_", "-"), metavar=key.upper(),
                            help=f"{help_of(schema, key)} (config key {key}; {shown})")
    for flag, kv in switches.items():
        key = kv.partition("=")[0]
        parser.add_argument(flag, action="store_true", help=f"sets {kv} ({key}: {help_of(schema, key)})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    args = vars(parser.parse_args(argv))
    dest = lambda flag: flag[2:].replace("-", "_")  # noqa: E731
    overrides = [f"{key}={args[key]}" for key in flags if args[key] is not None]
    overrides += [kv for flag, kv in switches.items() if args[dest(flag)]]
    for flag, (key, _) in repeated.items():
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
