"""The `vllm serve` line for an export at a stated load, from the serving policy `draftsmith
compare --write-policy` measured and recorded in it (export/policy.py).

    draftsmith serve-line runs/demo/export-bf16 --concurrency 8 [--target HF_ID]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from export import formats, policy
from recipes._common import one_line_errors
from trainer.errors import DraftsmithError
from trainer.serving import KNOBS


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="draftsmith serve-line", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir", help="an export holding serving/policy.json (draftsmith compare --write-policy)")
    ap.add_argument("--concurrency", type=int, required=True, help="requests in flight you will serve")
    ap.add_argument("--target", help="the target as vLLM should load it (a Hub id); default: its local folder")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.concurrency < 1:
        raise DraftsmithError(f"--concurrency {args.concurrency}: give the requests in flight, >= 1")
    root = Path(args.export_dir).expanduser()
    if not (root / formats.EXPORT_MANIFEST).is_file():
        raise DraftsmithError(f"'{root}' is not an export (no {formats.EXPORT_MANIFEST}); pass a `draftsmith export` "
                              "folder")
    measured = policy.read(root)
    if measured is None:
        raise DraftsmithError(f"'{root}' holds no serving policy; run `draftsmith compare --drafts {root} "
                              "--write-policy` first")
    manifest = json.loads((root / formats.EXPORT_MANIFEST).read_text())
    at = policy.load_for(measured, args.concurrency)
    m = measured["measured"]
    print(f"# measured at concurrency {at['concurrency']} in vLLM {m.get('vllm')} "
          f"({(m.get('mode') or {}).get('platform', '?')}, target in {m.get('dtype')}): "
          + (f"N={at['serve']['num_speculative_tokens']}"
             + "".join(f", vLLM's {k}={json.dumps(v)}" for k, v in at["serve"].items() if k in KNOBS)
             + f", {at['tokens_per_s']:.1f} ± {at['se']:.1f} tok/s against "
             f"{at['plain_tokens_per_s']:.1f} ± {at['plain_se']:.1f} without speculation" if at["serve"]
             else f"without speculation ({at['why']})")
          + (f"; excluded: {measured['excluded']}" if measured.get("excluded") else ""))
    print(policy.serve_line(measured, manifest, args.concurrency, args.target))


if __name__ == "__main__":
    main()
