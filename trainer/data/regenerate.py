"""Regeneration: replace each assistant turn with the target's own answer.

Drafts trained on the target's own outputs accept more (EAGLE-3 paper §4,
SpecForge "regenerate"). Turns are regenerated in order, so assistant turn j
sees the target's answers to turns < j; conversations are batched per turn with
left padding and HF `generate` runs in-process.
"""

from __future__ import annotations

import torch

from trainer.data.chat import render


@torch.no_grad()
def regenerate(target, conversations: list[list[dict]], *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, batch_size: int = 8, seed: int = 0,
               chat_template: str | None = None, progress=None) -> list[list[dict]]:
    tok = target.tokenizer
    convs = [[dict(m) for m in c] for c in conversations]
    turns = [[j for j, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    eos = [t for t in {tok.eos_token_id, *_as_list(target.model.generation_config.eos_token_id)} if t is not None]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    sample = temperature > 0
    for a in range(max((len(t) for t in turns), default=0)):
        todo = [(c, turns[c][a]) for c in range(len(convs)) if a < len(turns[c])]
        prompts = {c: tok(render(tok, convs[c][:j], add_generation_prompt=True, chat_template=chat_template),
                          add_special_tokens=False)["input_ids"] for c, j in todo}
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
            torch.manual_seed(seed + a * 1_000_003 + b)
            out = target.model.generate(
                input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad, eos_token_id=eos,
                **({"temperature": temperature, "top_p": top_p, "top_k": top_k} if sample else {}),
            )
            for r, (c, j) in enumerate(batch):
                convs[c][j]["content"] = tok.decode(out[r, width:], skip_special_tokens=True).strip()
            if progress is not None:
                progress(len(batch))
    return convs


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
