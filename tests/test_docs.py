"""The README and docs/ say only what is true of the code: every command they show that runs
draftsmith (`draftsmith <sub>`, `python recipes/x.py`, `accelerate launch recipes/x.py`,
`make <target>`, a script under scripts/) parses against the real command line, and every
`key=value` override names a config field (the project's own `load_config`, its `validate()`
included); no line passes 120 columns; the README stays a five-minute read (<= 250 lines); every
relative link resolves to a file (and a `#heading` in it).

Nothing is loaded or run: each recipe's real `main` is called with its argument parsing and
config loading intact and stopped right after them. `DRAFTSMITH_README=README.new.md` checks
another README in place of README.md (while a new one is written beside the old).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import os
import re
import runpy
import shlex
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / os.environ.get("DRAFTSMITH_README", "README.md")
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_COLUMNS = 120
MAX_README_LINES = 250

PYTHONS = ("python", "python3", ".venv/bin/python")
CONTROL = {"&&", "||", ";", "|"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass
class Command:
    page: Path
    line: int  # 1-based, where the command starts
    tokens: list[str]
    partial: bool  # shown with `...` (a fragment): flags and key names checked, not required keys

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}:{' '.join(self.tokens[:3])}"


def _code_lines(page: Path):
    """(line number, text) of every line inside a fenced code block, continuations joined."""
    inside, pending, start = False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        stripped = line.strip()
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def commands(page: Path) -> list[Command]:
    out = []
    for number, text in _code_lines(page):
        text = text.removeprefix("$ ")
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError:  # not shell (a diagram, an unbalanced quote in prose-like output)
            continue
        group: list[str] = []
        for token in [*tokens, ";"]:
            if token not in CONTROL:
                group.append(token)
                continue
            while group and ENV.match(group[0]):
                group.pop(0)
            if group and _runs_draftsmith(group):
                partial = "..." in group or any("…" in t for t in group)
                out.append(Command(page, number, [t for t in group if t not in ("...", "…")], partial))
            group = []
    return out


def _runs_draftsmith(tokens: list[str]) -> bool:
    first = tokens[0]
    second = tokens[1] if len(tokens) > 1 else ""
    if first in ("draftsmith", "make"):
        return True
    if first in PYTHONS:
        return second.startswith(("recipes/", "scripts/")) or (second == "-m" and len(tokens) > 2
                                                                and tokens[2].startswith("recipes."))
    if first == "accelerate":
        return second == "launch"
    return first == "bash" and second.startswith("scripts/")


ALL = [c for page in PAGES if page.is_file() for c in commands(page)]


# ---- running a command's parsing and config loading, and nothing else -------------------------------

class _Parsed(Exception):
    """Parsing and config loading finished: the command is valid."""


class _Wrong(Exception):
    """The command is not valid: the message says why."""


REAL_PARSE_ARGS = argparse.ArgumentParser.parse_args


def _load_config_stopping(real, partial: bool):
    import yaml

    from trainer.config.loader import _check_keys, _parse_overrides
    from trainer.errors import DraftsmithError

    def load_config(schema, path=None, overrides=None):
        try:
            cfg = real(schema, path, overrides)
        except DraftsmithError as err:
            if not partial:
                raise _Wrong(f"config: {err}") from None
            try:  # a fragment may leave required keys out: its key names must still exist
                if path is not None:
                    _check_keys(schema, yaml.safe_load(Path(path).read_text()) or {}, str(path))
                _check_keys(schema, _parse_overrides(list(overrides or []), schema), "override")
            except DraftsmithError as err2:
                raise _Wrong(f"config: {err2}") from None
            cfg = None
        raise _Parsed(cfg)

    return load_config


def _stop_after_parse():
    def parse_args(self, args=None, namespace=None):
        ns = REAL_PARSE_ARGS(self, args, namespace)
        # recipes/_common.py's parsers take key=value overrides: load_config comes next and stops there
        if not any(a.dest == "overrides" for a in self._actions):
            raise _Parsed(ns)
        return ns

    return parse_args


def _never_run(*_args, **_kwargs):
    raise _Wrong("the command reached its stage's run() without loading a config through load_config: "
                 "tests/test_docs.py must learn the new parsing path")


@functools.cache
def _real_load_config():
    from trainer.config import loader

    return loader.load_config


def _call(fn, argv, modules, partial: bool, monkeypatch) -> None:
    """Call `fn(argv)` (a recipe's main, or a script) with parsing and config loading real and
    everything after them stopped; _Wrong on a flag argparse refuses or a config key that is not."""
    real = _real_load_config()
    stop = _load_config_stopping(real, partial)
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("recipes", "trainer", "export") and module is not None:
            if getattr(module, "load_config", None) is real:
                monkeypatch.setattr(module, "load_config", stop)
    for module in modules:
        if callable(getattr(module, "run", None)):
            monkeypatch.setattr(module, "run", _never_run)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", _stop_after_parse())
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            fn(argv)
    except _Parsed:
        return
    except SystemExit as exit_:
        if exit_.code in (0, None):
            return
        said = err.getvalue().strip()
        raise _Wrong(said.splitlines()[-1] if said else f"exit {exit_.code}") from None
    raise _Wrong("the command returned without parsing its arguments")


def _recipe(module_name: str, argv: list[str], partial: bool, monkeypatch) -> None:
    module = importlib.import_module(module_name)
    _call(module.main, argv, [module], partial, monkeypatch)


def _cli(argv: list[str], partial: bool, monkeypatch) -> None:
    from recipes import cli

    if not argv:
        raise _Wrong("`draftsmith` with no command")
    if argv[0] in cli.COMMANDS:
        module = importlib.import_module(cli.COMMANDS[argv[0]][1])
        modules = [module]
    else:
        modules = []
    _call(cli.main, argv, modules, partial, monkeypatch)


def _script(path: str, argv: list[str], monkeypatch) -> None:
    file = REPO / path
    if not file.is_file():
        raise _Wrong(f"{path} does not exist")
    if file.suffix != ".py":
        return

    def run(args):
        monkeypatch.setattr(sys, "argv", [str(file), *args])
        try:
            runpy.run_path(str(file), run_name="__main__")
        except ModuleNotFoundError as err:  # a peer's environment (speculators, vllm): its flags go unchecked
            pytest.skip(f"{path} imports {err.name}, not installed here")

    _call(run, argv, [], False, monkeypatch)


def _make_targets() -> dict[str, list[str]]:
    """Makefile target -> its recipe lines."""
    targets: dict[str, list[str]] = {}
    current = None
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z][\w-]*)\s*:(?!=)", line)
        if m:
            current = targets.setdefault(m.group(1), [])
        elif line.startswith("\t") and current is not None:
            current.append(line.strip())
        elif line and not line.startswith("#"):
            current = None
    return targets


def _make(argv: list[str], partial: bool, monkeypatch) -> None:
    targets = _make_targets()
    args = next((t[len("ARGS="):] for t in argv if t.startswith("ARGS=")), "")
    for token in argv:
        if ENV.match(token):  # ARGS=..., WORKERS=0
            continue
        elif token not in targets:
            raise _Wrong(f"make {token}: the Makefile has no such target ({', '.join(sorted(targets))})")
        else:
            for line in targets[token]:  # a target that runs a recipe: its ARGS are that recipe's overrides
                m = re.search(r"-m (recipes\.\w+) (.*)\$\(ARGS\)", line)
                if m and args:
                    _recipe(m.group(1), [*shlex.split(m.group(2)), *shlex.split(args)], partial, monkeypatch)


def _accelerate(argv: list[str], partial: bool, monkeypatch) -> None:
    from accelerate.commands.launch import launch_command_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            launched = REAL_PARSE_ARGS(launch_command_parser(), argv)
    except SystemExit:
        raise _Wrong(f"accelerate launch: {err.getvalue().strip().splitlines()[-1]}") from None
    if launched.config_file and not (REPO / launched.config_file).is_file():
        raise _Wrong(f"accelerate launch --config_file {launched.config_file}: no such file")
    script = launched.training_script
    if not script.startswith("recipes/") or not (REPO / script).is_file():
        raise _Wrong(f"accelerate launch {script}: not a recipe under recipes/")
    _recipe("recipes." + Path(script).stem, launched.training_script_args, partial, monkeypatch)


def check(command: Command, monkeypatch) -> None:
    first, rest = command.tokens[0], command.tokens[1:]
    if first == "draftsmith":
        _cli(rest, command.partial, monkeypatch)
    elif first == "make":
        _make(rest, command.partial, monkeypatch)
    elif first == "accelerate":
        _accelerate(rest[1:], command.partial, monkeypatch)
    elif first == "bash":
        _script(rest[0], rest[1:], monkeypatch)
    elif rest[0] == "-m":
        _recipe(rest[1], rest[2:], command.partial, monkeypatch)
    elif rest[0].startswith("recipes/"):
        if not (REPO / rest[0]).is_file():
            raise _Wrong(f"{rest[0]} does not exist")
        _recipe("recipes." + Path(rest[0]).stem, rest[1:], command.partial, monkeypatch)
    else:
        _script(rest[0], rest[1:], monkeypatch)


def test_the_docs_show_commands():
    """The extraction finds the README's and the docs' commands (a broken extractor checks nothing)."""
    assert len([c for c in ALL if c.page == README]) >= 2, f"{README.name} shows no draftsmith command"
    assert len(ALL) >= 20


@pytest.mark.parametrize("command", ALL, ids=[c.id for c in ALL])
def test_command_parses_against_the_cli(command, monkeypatch):
    monkeypatch.chdir(REPO)  # relative paths (--config FILE) as a reader at the repository root has them
    try:
        check(command, monkeypatch)
    except _Wrong as err:
        pytest.fail(f"{command.id}: `{' '.join(command.tokens)}`\n  {err}", pytrace=False)


# ---- the page rules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_line_over_120_columns(page):
    long = [f"{page.name}:{i}: {len(line)} columns" for i, line in enumerate(page.read_text().splitlines(), 1)
            if len(line) > MAX_COLUMNS]
    assert not long, "\n".join(long)


def test_readme_is_a_five_minute_read():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"{README.name} is {lines} lines; move detail into docs/ (<= {MAX_README_LINES})"


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)  # [name]: target


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    inside = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        if inside or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are code
    broken = []
    for target in LINK.findall(text) + REFERENCE.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if file == (REPO / "README.md").resolve():  # the README under test (DRAFTSMITH_README), not the old one
            file = README
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: {file.name} has no heading #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("text", [
    "draftsmith eval --draft ngram --no-such-flag 3",
    "draftsmith prepare --config recipes/configs/smollm2-135m/prepare.yaml max_record=200",
    "accelerate launch recipes/train.py --config recipes/configs/smollm2-135m/eagle3.yaml draft.ttt_step=3",
    "python recipes/capture.py --config recipes/configs/smollm2-135m/capture.yaml engine=nope",
    "draftsmith upload runs/x",
    "draftsmith exprot --draft runs/x --output-dir runs/y",
    "make demo ARGS=overwrit=true",
    "make nothing",
    "accelerate launch --bogus recipes/train.py",
    ".venv/bin/python scripts/bench_decode.py --no-such-flag",
    "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu recipes/train.py ... online.engin=hf",
])
def test_the_checker_refuses_what_does_not_run(text, tmp_path, monkeypatch):
    """A checker that passes everything checks nothing: each of these must be refused."""
    page = tmp_path / "page.md"
    page.write_text(f"```bash\n{text}\n```\n")
    monkeypatch.chdir(REPO)
    found = commands(page)
    assert len(found) == 1
    with pytest.raises(_Wrong):
        check(found[0], monkeypatch)


def test_the_settings_reference_is_current():
    """docs/config.md is generated from the schemas (each setting's help and bounds declared with it):
    a setting added, renamed or re-described without rewriting the page fails here."""
    from trainer.config import REFERENCE
    from trainer.settings import reference_page

    page = (REPO / "docs" / "config.md").read_text()
    assert page == reference_page(REFERENCE) + "\n", "stale: run .venv/bin/python scripts/config_reference.py"


def test_every_setting_has_its_help():
    """Every key of every stage and of every algorithm's draft section has its help where it is
    declared (what --help, the suggestions and the reference print); a nested section's keys too."""
    from trainer.config import REFERENCE
    from trainer.settings import reference

    bare = [f"{stage}: {row['key']}" for stage, schema in REFERENCE.items() for row in reference(schema)
            if not row["help"].strip()]
    assert not bare, bare

