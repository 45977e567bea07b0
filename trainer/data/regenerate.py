"""Regeneration: replace each assistant turn with the target's own answer.

Drafts trained on the target's own outputs accept more (EAGLE-3 paper §4, SpecForge
"regenerate"). Turns are regenerated in order, so assistant turn j sees the target's answers to
turns < j. Two engines produce the same records: transformers' `generate` here (`regenerate`,
conversations batched per turn with left padding) and vLLM in its own environment
(export/regenerate.py, continuous batching). A record is one answer, {"conv", "turn",
"token_ids", "text", "finish_reason": "stop" | "length"}, or {"conv", "turn", "skip":
"prompt_too_long"}; `apply_answers` turns them into conversations by one rule for both.

The rule: a prompt with no room for an answer within max_model_len, an empty answer, or (with
truncated="drop") an answer cut at max_new_tokens ends its conversation after the last good
answer; the turns dropped are counted, and a conversation left with no answer is skipped with
that reason.
"""

from __future__ import annotations

from collections import Counter

import torch

from trainer.data.chat import render

# why a regenerated conversation ends early (a dropped turn's kind) or is skipped (no answer left)
END_REASONS = {"prompt_too_long": "regenerate_prompt_too_long", "empty": "regenerate_empty_answer",
               "length": "regenerate_answer_truncated"}


def ends_well(record: dict, truncated: str) -> bool:
    """An answer its conversation goes on from."""
    return "skip" not in record and bool(record.get("text")) and not (
        truncated == "drop" and record.get("finish_reason") == "length")


def end_reason(record: dict) -> str:
    return END_REASONS["prompt_too_long" if "skip" in record else "empty" if not record.get("text") else "length"]


@torch.no_grad()
def regenerate(target, conversations: list[list[dict]], *, max_new_tokens: int, max_model_len: int,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, truncated: str = "keep",
               batch_size: int = 8, seed: int = 0, chat_template: str | None = None, progress=None) -> list[dict]:
    """The target's answers through transformers' generate: the records (module docstring) of
    every turn generated, in order."""
    tok = target.tokenizer
    convs = [[dict(m) for m in c] for c in conversations]
    turns = [[j for j, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    eos = [t for t in {tok.eos_token_id, *_as_list(target.model.generation_config.eos_token_id)} if t is not None]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    sample = temperature > 0
    records, stopped = [], set()
    for a in range(max((len(t) for t in turns), default=0)):
        todo = [(c, turns[c][a]) for c in range(len(convs)) if a < len(turns[c]) and c not in stopped]
        prompts = {c: tok(render(tok, convs[c][:j], add_generation_prompt=True, chat_template=chat_template),
                          add_special_tokens=False)["input_ids"] for c, j in todo}
        for c, j in [cj for cj in todo if max_model_len - len(prompts[cj[0]]) < 1]:
            records.append({"conv": c, "turn": j, "skip": "prompt_too_long"})
            stopped.add(c)
        todo = [cj for cj in todo if cj[0] not in stopped]
        todo.sort(key=lambda cj: len(prompts[cj[0]]))  # similar lengths share a batch: less padding
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            width = max(len(prompts[c]) for c, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, T], left padded
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (c, _) in enumerate(batch):
                p = prompts[c]
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            # an answer fits the model: each row is capped by the room its prompt leaves, as vLLM caps
            # max_tokens (generation is causal: a longer run cut to a row's room is that row's run)
            room = {c: min(max_new_tokens, max_model_len - len(prompts[c])) for c, _ in batch}
            torch.manual_seed(seed + a * 1_000_003 + b)
            out = target.model.generate(
                input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                max_new_tokens=max(room.values()), do_sample=sample, pad_token_id=pad, eos_token_id=eos,
                **({"temperature": temperature, "top_p": top_p, "top_k": top_k} if sample else {}),
            )
            for r, (c, j) in enumerate(batch):
                new = out[r, width:width + room[c]].tolist()
                end = next((k + 1 for k, t in enumerate(new) if t in eos), None)  # the end token is kept, as vLLM
                new = new[:end] if end is not None else new
                record = {"conv": c, "turn": j, "token_ids": new,
                          "text": tok.decode(new, skip_special_tokens=True).strip(),
                          "finish_reason": "stop" if end is not None else "length"}
                records.append(record)
                convs[c][j]["content"] = record["text"]
                if not ends_well(record, truncated):
                    stopped.add(c)
            if progress is not None:
                progress(len(batch))
    return records


def apply_answers(conversations: list[list[dict]], records: list[dict], truncated: str):
    """Conversations with their assistant turns replaced by the records' answers.

    Returns (conversations: None where none is left, the reason each None was skipped,
    Counter of turns dropped by reason)."""
    by_turn = {(r["conv"], r["turn"]): r for r in records}
    out, skipped, dropped = [], {}, Counter()
    for c, conv in enumerate(conversations):
        messages, keep = [dict(m) for m in conv], 0  # keep: messages up to the last good answer
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            r = by_turn.get((c, j))
            if r is None or not ends_well(r, truncated):
                reason = end_reason(r) if r is not None else None
                if reason is not None and keep:
                    dropped[reason] += sum(x["role"] == "assistant" for x in messages[j:])
                elif reason is not None:
                    skipped[c] = reason
                break
            m["content"] = r["text"]
            keep = j + 1
        out.append(messages[:keep] if keep else None)
    return out, skipped, dropped


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
