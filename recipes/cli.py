"""The `draftsmith` console script: the non-training stages.

    draftsmith prepare --config recipes/configs/smollm2-135m/prepare.yaml [key=value ...]
    draftsmith capture --config recipes/configs/smollm2-135m/capture.yaml [key=value ...]
    draftsmith eval    --draft ngram --dataset gsm8k --num-draft-tokens 4 [--temperature T] [key=value ...]
    draftsmith compare --drafts runs/demo/export-bf16 runs/demo/export-fp8 --concurrency 1,4,16 [--no-vllm]
    draftsmith export  --draft runs/demo/eagle3 --output-dir runs/demo/export-fp8 [--quantize fp8] [--overwrite]
    draftsmith upload  runs/demo/export-fp8 --repo me/name --dry-run   (then without --dry-run)
    draftsmith serve-line runs/demo/export-bf16 --concurrency 8     (after compare --write-policy)
    draftsmith demo    [key=value ...]
    draftsmith inspect-capture runs/demo/capture      (verify shard hashes, print the summary)

Training runs under `accelerate launch recipes/train.py` (or `python recipes/train.py`): it needs a launcher.
"""

from __future__ import annotations

import difflib
import importlib
import sys

# command -> (what it does, the module whose `main` runs it, that function's name). Each stage's
# module is imported when its command runs, so `draftsmith --help` never loads torch.
COMMANDS = {
    "prepare": ("tokenize chats with the target's template and an assistant loss mask", "recipes.prepare", "main"),
    "capture": ("capture multi-layer hidden states of the frozen target", "recipes.capture", "main"),
    "eval": ("measure a draft with the in-tree speculative decoder (τ, acceptance, speedup, best N)",
             "recipes.eval", "main"),
    "compare": ("which draft, N and precision to serve at each concurrency: exports, vLLM's n-gram and no "
                "speculation measured on your prompts", "recipes.compare", "main"),
    "export": ("write a trained draft as a vLLM draft folder, BF16 or FP8 (AMD Quark), FP8 gated on τ",
               "recipes.export_draft", "main"),
    "upload": ("publish an export to the Hugging Face Hub with a model card of its measured numbers",
               "recipes.upload", "main"),
    "serve-line": ("the `vllm serve` line for an export at a load, from the policy compare measured into it",
                   "recipes.serve_line", "main"),
    "demo": ("prepare -> capture -> train -> export BF16 + FP8 -> eval, on the embedded SmolLM2 target",
             "recipes.demo", "main"),
    "inspect-capture": ("verify a capture's shards against its manifest and print its summary",
                        "recipes.capture", "inspect_main"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands:\n" + "\n".join(f"  {k:<16} {v[0]}" for k, v in COMMANDS.items()))
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; commands: {', '.join(COMMANDS)}"
        print(f"error: unknown command '{command}'{hint}", file=sys.stderr)
        raise SystemExit(2)
    _, module, function = COMMANDS[command]
    getattr(importlib.import_module(module), function)(rest)


if __name__ == "__main__":
    main()
