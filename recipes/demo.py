"""The demo: prepare -> capture on the embedded target (SmolLM2-135M-Instruct) with a
small ShareGPT slice, ending in a printed summary.

    make demo                      (sets up .venv, then runs this)
    python -m recipes.demo --config recipes/configs/smollm2-135m/demo.yaml [key=value ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from recipes import capture, prepare
from recipes._common import one_line_errors, parse_args
from trainer.config import DemoConfig


def run(cfg: DemoConfig, argv: list[str] | None = None) -> dict:
    out = Path(cfg.output_dir)
    cfg.prepare.target = cfg.capture.target = cfg.target
    cfg.prepare.output_dir = str(out / "prepared")
    cfg.capture.data = cfg.prepare.output_dir
    cfg.capture.output_dir = str(out / "capture")
    cfg.prepare.overwrite = cfg.capture.overwrite = cfg.overwrite or cfg.prepare.overwrite

    t0 = time.perf_counter()
    print(f"[1/2] prepare: {cfg.prepare.max_records} records of '{cfg.prepare.source}' -> {cfg.prepare.output_dir}")
    prepared = prepare.run(cfg.prepare, argv)
    print(prepare.format_summary(prepared))
    print(f"[2/2] capture: {cfg.target} -> {cfg.capture.output_dir}")
    manifest = capture.run(cfg.capture, argv)
    print(capture.format_summary(manifest))
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; outputs in {out}/")
    return {"prepare": prepared, "capture": manifest}


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(DemoConfig, argv, __doc__.splitlines()[0])
    if Path(cfg.output_dir).exists() and not cfg.overwrite:
        print(f"demo: {cfg.output_dir} exists; re-running with overwrite=true")
        cfg.overwrite = True
    run(cfg, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
