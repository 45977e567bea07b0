"""Conversations -> token ids + an assistant-only loss mask, with the target's chat template.

Many templates (SmolLM2's ChatML among them) have no `{% generation %}` tags, so
`return_assistant_tokens_mask` cannot be used. Instead each assistant span is
found by rendering prefixes: the text of turns [0, j) with the generation prompt
ends where assistant turn j's content starts, and the text of turns [0, j] ends
where it stops (its end-of-turn token included: the draft must learn to stop).
This needs the template to be prefix-stable, which is checked per record.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

from jinja2.exceptions import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainer.errors import DataError

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}

# Why a record was skipped (counted per reason in every prepare summary).
SKIP_REASONS = {
    "empty": "no turns",
    "invalid_json": "the line is not JSON",
    "unknown_role": "a turn's role is not user/assistant/system (or a ShareGPT alias)",
    "non_string_content": "a turn's content is not a string",
    "non_alternating": "user and assistant turns do not alternate (or a system turn is not first)",
    "no_assistant": "no assistant turn with content to learn from",
    "too_long": "longer than max_length tokens",
    "template_not_prefix": "the chat template does not render this conversation prefix-stably",
    "control_token": "a turn's text contains a special token of the tokenizer (it would forge a turn)",
    "control_characters": "a turn's text contains control characters (NUL, escape, bidi overrides, ...)",
    "duplicate": "its first user turn repeats an earlier conversation's (a mixture keeps one of each)",
    # regeneration (trainer/data/regenerate.py): the target left no answer to keep
    "regenerate_prompt_too_long": "regenerating: its first prompt leaves no room for an answer in max_model_len",
    "regenerate_empty_answer": "regenerating: the target's first answer is empty",
    "regenerate_answer_truncated": "regenerating: the target's first answer was cut at max_new_tokens "
                                   "(regenerate.truncated=drop)",
}

# C0 controls but tab, newline and carriage return; DEL; C1 controls; Unicode bidi embeddings,
# overrides and isolates (the "Trojan Source" characters).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


class BadRecord(Exception):
    def __init__(self, reason: str, detail: str = ""):
        assert reason in SKIP_REASONS, reason
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail or SKIP_REASONS[reason]}")


# Turns dropped from a record that is kept (counted per kind in the prepare summary). ShareGPT
# conversations often start with the assistant (a third of the packaged ones): FastChat's and
# EAGLE's preprocessing drop that turn and keep the conversation, and so does draftsmith.
DROPPED_TURNS = {
    "leading_assistant_dropped": "an assistant turn before the first user turn (no question to answer)",
    "trailing_user_dropped": "a user turn after the last answer (a question nobody answered)",
    # regeneration: the turns from the first one without a good answer on (the conversation is kept up to it)
    "regenerate_prompt_too_long": "regenerating: a later prompt leaves no room for an answer in max_model_len",
    "regenerate_empty_answer": "regenerating: a later answer is empty",
    "regenerate_answer_truncated": "regenerating: a later answer was cut at max_new_tokens (truncated=drop)",
}


def normalize(record: object, dropped: Counter | None = None) -> list[dict[str, str]]:
    """A ShareGPT (`conversations`: from/value) or "messages" (role/content) record ->
    [{"role", "content"}] alternating user/assistant after an optional system turn,
    ending on an assistant turn; assistant turns before the first user turn and user turns
    after the last answer are dropped (counted in `dropped`, DROPPED_TURNS). Raises BadRecord."""
    if isinstance(record, dict) and "__invalid_json__" in record:
        raise BadRecord("invalid_json", record["__invalid_json__"])
    turns = None
    if isinstance(record, dict):
        for key in ("messages", "conversations", "conversation"):
            if key in record:
                turns = record[key]
                break
    elif isinstance(record, list):
        turns = record
    if not turns or not isinstance(turns, list):
        raise BadRecord("empty")
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord("unknown_role", f"turn {k} is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise BadRecord("unknown_role", f"turn {k} has role {role!r}")
        if not isinstance(content, str):
            raise BadRecord("non_string_content", f"turn {k} content is {type(content).__name__}")
        bad = _CONTROL.search(content)
        if bad:
            raise BadRecord("control_characters", f"turn {k} has U+{ord(bad.group()):04X} at character {bad.start()}")
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    if not body:
        raise BadRecord("empty", "only a system turn")
    counts = Counter()
    while body and body[0]["role"] == "assistant":  # an answer to no question: the turn goes, the chat stays
        body = body[1:]
        counts["leading_assistant_dropped"] += 1
    skipped = len(messages) - len(head) - len(body)
    for k, m in enumerate(body):
        if m["role"] != ("user" if k % 2 == 0 else "assistant"):
            raise BadRecord("non_alternating", f"turn {k + len(head) + skipped} is {m['role']}")
    messages = head + body
    while messages and messages[-1]["role"] != "assistant":  # a trailing question teaches nothing
        if messages[-1]["role"] == "user":
            counts["trailing_user_dropped"] += 1
        messages.pop()
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise BadRecord("no_assistant")
    if dropped is not None:
        dropped.update(counts)
    return messages


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1 exactly on assistant tokens (content and end-of-turn)


def _is_file(given: str) -> bool:
    return os.path.isfile(given)  # False, never an error, for text that cannot be a path


def template_file(given: str | None) -> str | None:
    """The file a given chat template names (read_template's rule: a path where a file exists
    is that file, else text holding a `{` is the template itself), or None: what a stage that
    reads it must protect from its output."""
    return given if given and (_is_file(given) or "{" not in given) else None


def read_template(given: str | None, where: str) -> str | None:
    """The text of a given chat template: the file `given` names where one exists (its path may
    hold a `{`), else `given` itself when it is Jinja text (it holds a `{`); a file must be UTF-8
    and not empty; compiled once, before any work (check_template). None when none was given.
    One line for each problem."""
    if given is None:
        return None
    text = given
    if _is_file(given):
        try:
            with open(given, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"{where}: chat template file '{given}' cannot be read ({err}); pass a UTF-8 Jinja file") \
                from None
        if not text.strip():
            raise DataError(f"{where}: chat template file '{given}' is empty; write a Jinja chat template into it, "
                            "or give none to use the target's own")
    elif "{" not in given:
        raise DataError(f"{where}: chat template '{given}' is neither Jinja text nor a file (looked for it from "
                        f"{os.getcwd()}); pass the path of a Jinja file or the template itself")
    check_template(text, where)
    return text


# A chat a template is tried on before any work: its content must come out in the rendering.
PROBE = [{"role": "user", "content": "Probe question 17?"}, {"role": "assistant", "content": "Probe answer 42."}]


def resolve_template(tokenizer, given: str | None, where: str, owner: str = "the target") -> str:
    """The chat template to use: `given` (the text of a Jinja template, or a path to a file
    holding one: read_template) or the tokenizer's own; checked once, before any work: it
    compiles, renders a user/assistant chat, and writes the messages' content (a file of plain
    text does not). One line when there is none or it fails (naming its line)."""
    text = read_template(given, where)
    text = text if text is not None else getattr(tokenizer, "chat_template", None)
    if not text:
        raise DataError(f"{owner} has no chat template and none was given ({where}); pass a Jinja chat template "
                        "(for a base model, e.g. recipes/configs/gemma-3-270m/turns.jinja), or use plain prompts "
                        "where the stage offers it (eval --no-chat-template)")
    check_template(text, where)
    try:  # what compiling cannot see (an unknown test, a bad operation): one render of the simplest chat
        rendered = [render(tokenizer, PROBE[:n], gen, text) for n, gen in ((1, True), (2, False))]
    except Exception as err:  # whatever the template raises on a plain chat (TemplateError, TypeError, ...)
        raise DataError(f"{where}: the chat template fails to render a user/assistant chat ({type(err).__name__}: "
                        f"{err}); fix it") from None
    missing = [m["role"] for m, r in zip(PROBE, rendered) if m["content"] not in r]
    if missing:
        which = f"file '{given}'" if given and template_file(given) else "given" if given else f"of {owner}"
        shown = rendered[1] if len(rendered[1]) <= 60 else rendered[1][:57] + "..."
        raise DataError(f"{where}: the chat template {which} renders no message content (a user/assistant chat "
                        f"renders as {shown!r}, without the {' or '.join(missing)} turn's text); give a Jinja chat "
                        "template that writes each message's content, e.g. {{ message['content'] }}")
    return text


def check_template(text: str, where: str) -> None:
    """A Jinja template that compiles, as transformers compiles chat templates (a sandboxed
    environment with its loop controls; compiling, not only parsing, so an unknown filter or
    test is caught too): one line naming the line of the error, before any record is read."""
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).from_string(text)
    except TemplateSyntaxError as err:  # TemplateAssertionError (unknown filter/test) is one too
        raise DataError(f"{where}: the chat template is not valid Jinja (line {err.lineno}: {err.message}); fix it") \
            from None


def render(tokenizer, messages, add_generation_prompt=False, chat_template=None) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )


def assistant_char_spans(tokenizer, messages, chat_template=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn."""
    full = render(tokenizer, messages, chat_template=chat_template)
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:j], add_generation_prompt=True, chat_template=chat_template)
        through = render(tokenizer, messages[: j + 1], chat_template=chat_template)
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            raise BadRecord("template_not_prefix", f"assistant turn {j}")
        # Trailing whitespace after the end-of-turn token belongs to the template, not the answer.
        spans.append((len(before), len(through.rstrip())))
    return full, spans


def special_strings(tokenizer) -> list[str]:
    """Every string the tokenizer turns into a special token (its special and added special
    tokens), longest first."""
    found = set(tokenizer.all_special_tokens)
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            found.add(str(token))
    return sorted((t for t in found if t), key=len, reverse=True)


def check_no_control_tokens(tokenizer, messages) -> None:
    """Text must never become a control token: a turn containing `<|im_start|>system ...`
    would be tokenized as a real turn boundary and train the draft on a forged turn.
    Such records are skipped (reason control_token)."""
    specials = special_strings(tokenizer)
    for k, m in enumerate(messages):
        hits = [(m["content"].find(t), t) for t in specials if t in m["content"]]
        if hits:
            at, token = min(hits)  # the first one in the text
            raise BadRecord("control_token", f"turn {k} contains {token!r} at character {at}")


def tokenize_chat(tokenizer, messages, max_length: int, chat_template=None) -> Tokenized:
    """Token ids of the rendered chat and the assistant loss mask; raises BadRecord."""
    check_no_control_tokens(tokenizer, messages)
    full, spans = assistant_char_spans(tokenizer, messages, chat_template)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if len(ids) > max_length:
        raise BadRecord("too_long", f"{len(ids)} tokens > max_length {max_length}")
    mask = [0] * len(ids)
    k = 0
    for t, (start, _end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if spans[k][0] <= start < spans[k][1]:  # a token belongs to the turn its first character is in
            mask[t] = 1
    if not any(mask):
        raise BadRecord("no_assistant", "assistant turns rendered to no tokens")
    return Tokenized(ids, mask)


def count_reasons(reasons) -> dict[str, int]:
    return dict(sorted(Counter(reasons).items()))
