"""Write docs/config.md, the settings reference, from the stage schemas (trainer/settings.py
`reference_page`); tests/test_docs.py fails when the page is stale.

    .venv/bin/python scripts/config_reference.py            # rewrite docs/config.md
    .venv/bin/python scripts/config_reference.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.config import REFERENCE
from trainer.io import atomic_write_text
from trainer.settings import reference_page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale; write nothing")
    args = ap.parse_args()
    page = reference_page(REFERENCE) + "\n"
    if args.check:
        stale = not PAGE.is_file() or PAGE.read_text() != page
        print(f"{PAGE}: {'stale: run scripts/config_reference.py' if stale else 'up to date'}")
        sys.exit(1 if stale else 0)
    atomic_write_text(PAGE, page)
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
