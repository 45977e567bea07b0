"""The `draftsmith` console script: the non-training stages.

    draftsmith prepare --config recipes/configs/smollm2-135m/prepare.yaml [key=value ...]
    draftsmith capture --config recipes/configs/smollm2-135m/capture.yaml [key=value ...]
    draftsmith eval    --draft ngram --dataset gsm8k --num-draft-tokens 4 [--temperature T] [key=value ...]
    draftsmith export  --draft runs/demo/eagle3 --output-dir runs/demo/export-fp8 [--quantize fp8] [--overwrite]
    draftsmith upload  runs/demo/export-fp8 --repo me/name --dry-run   (then without --dry-run)
    draftsmith demo    [key=value ...]
    draftsmith inspect-capture runs/demo/capture      (verify shard hashes, print the summary)

Training runs under `accelerate launch recipes/train.py` (a later stage).
"""

from __future__ import annotations

import sys

from recipes._common import one_line_errors

COMMANDS = {
    "prepare": "tokenize chats with the target's template and an assistant loss mask",
    "capture": "capture multi-layer hidden states of the frozen target",
    "eval": "measure a draft with the in-tree speculative decoder (τ, acceptance, speedup, best N)",
    "export": "write a trained draft as a vLLM draft folder, BF16 or FP8 (AMD Quark), FP8 gated on τ",
    "upload": "publish an export to the Hugging Face Hub with a model card of its measured numbers",
    "demo": "prepare -> capture -> train -> export BF16 + FP8 -> eval, on the embedded SmolLM2 target",
    "inspect-capture": "verify a capture's shards against its manifest and print its summary",
}


@one_line_errors
def _inspect_capture(argv: list[str]) -> None:
    import argparse

    from recipes.capture import format_summary
    from trainer.data.shards import verify_capture

    ap = argparse.ArgumentParser(prog="draftsmith inspect-capture",
                                 description="Verify a capture against its manifest (every shard's size, sha256, "
                                             "tensors and layer ids; the draft vocabulary) and print its summary.")
    ap.add_argument("capture_dir", help="the output_dir of `draftsmith capture`")
    argv = [ap.parse_args(argv).capture_dir]
    info = verify_capture(argv[0])
    print(format_summary(info.manifest))
    print(f"  all {len(info.manifest['shards'])} shard(s) match their sha256")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands:\n" + "\n".join(f"  {k:<16} {v}" for k, v in COMMANDS.items()))
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "prepare":
        from recipes.prepare import main as run
    elif command == "capture":
        from recipes.capture import main as run
    elif command == "eval":
        from recipes.eval import main as run
    elif command == "export":
        from recipes.export import main as run
    elif command == "upload":
        from recipes.upload import main as run
    elif command == "demo":
        from recipes.demo import main as run
    elif command == "inspect-capture":
        run = _inspect_capture
    else:
        import difflib

        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; commands: {', '.join(COMMANDS)}"
        print(f"error: unknown command '{command}'{hint}", file=sys.stderr)
        raise SystemExit(2)
    run(rest)


if __name__ == "__main__":
    main()
