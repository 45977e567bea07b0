"""Upload an export to the Hugging Face Hub with a generated model card.

    draftsmith upload runs/demo/export-fp8 --repo me/smollm2-eagle3-fp8 --dry-run
    draftsmith upload runs/demo/export-fp8 --repo me/smollm2-eagle3-fp8 [--private] [--exist-ok]
    flags: --revision BRANCH (commit to a branch of an existing repo), --endpoint URL (a Hub-compatible
           server), --base-model OWNER/NAME (the target's Hub id when it was loaded from a local folder),
           --compare DIR (a `draftsmith compare` of this export: served tokens/s per load in the card)

The export must be complete: config.json, model.safetensors, draftsmith_export.json
(every file matching its sha256) and eval/report.json (`draftsmith eval --draft EXPORT
--output-dir EXPORT/eval`). `--dry-run` needs no token and no network: it prints each
file with its size and sha256, then the card. The token comes from HF_TOKEN or
`hf auth login` and is never printed.
"""

from __future__ import annotations

import argparse
import os
import sys

from export import hub
from recipes._common import one_line_errors


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="draftsmith upload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir", help="the output folder of `draftsmith export` (with eval/report.json)")
    ap.add_argument("--repo", required=True, help="owner/name on the Hub")
    ap.add_argument("--dry-run", action="store_true", help="print the files and the card; no network")
    ap.add_argument("--private", action="store_true", help="create the repo private")
    ap.add_argument("--exist-ok", action="store_true", help="add a commit to an existing repo")
    ap.add_argument("--revision", help="a branch to commit to (created if missing)")
    ap.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    ap.add_argument("--base-model", help="the target's Hub id, when the export names a local folder")
    ap.add_argument("--compare", metavar="DIR", help="a `draftsmith compare` output folder that measured this "
                    "export: its served tokens/s per concurrency and its plot go into the card")
    ap.add_argument("--allow-extra-files", action="store_true",
                    help="also upload files added to the export after it was made (refused otherwise)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    args.export_dir = os.path.expanduser(args.export_dir)

    plan = hub.plan_upload(args.export_dir, args.repo, args.base_model, args.allow_extra_files, args.compare)
    visibility = "private" if args.private else "public"
    print(f"upload plan: {args.export_dir} -> {args.repo} ({visibility}"
          + (f", branch {args.revision}" if args.revision else "") + ")")
    print(plan.describe())
    print("\n--- README.md ---")
    print(plan.card)
    if args.dry_run:
        print("--- dry run: nothing was uploaded ---")
        return
    url = hub.upload(plan, args.repo, private=args.private, exist_ok=args.exist_ok, revision=args.revision,
                     endpoint=args.endpoint)
    print(f"uploaded {len(plan.files) + 1} files: {url}")


if __name__ == "__main__":
    main()
