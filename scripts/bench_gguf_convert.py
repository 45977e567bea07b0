"""What a GGUF target's first use costs: its conversion to an HF folder (trainer/target.py
`gguf_to_hf_dir`), with the file parsed once (`_each_gguf_parsed_once`, today's) against each loader
parsing it itself (transformers' tokenizer, model and config loaders, and the license read: the
conversion before), in the same run.

    .venv/bin/python scripts/bench_gguf_convert.py [--targets smollm2-135m-instruct,gemma-3-270m]
        [--threads 1] [--repeats 1]

Each conversion writes into a fresh temporary cache (DRAFTSMITH_CACHE), so nothing is reused; the
two ways' folders are compared file by file (sha256; draftsmith_source.json records the cache path,
so its `gguf` key is left out). Printed per target: one parse of the file, each way's conversion
time (median, min..max over --repeats) and how many times the file was parsed, and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def digest_files(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.iterdir()):
        data = p.read_bytes()
        if p.name == "draftsmith_source.json":
            data = json.dumps({k: v for k, v in json.loads(data).items() if k != "gguf"}).encode()
        out[p.name] = hashlib.sha256(data).hexdigest()
    return out


def convert(spec: str, memo: bool) -> tuple[float, int, dict[str, str]]:
    """One conversion into a fresh cache: (seconds, parses, sha256 per file)."""
    import gguf

    from trainer import target as target_mod

    parses = []
    counted = gguf.GGUFReader

    def counting(path, mode="r"):
        parses.append(path)
        return counted(path, mode)

    @contextlib.contextmanager
    def each_loader_parses():  # the conversion before: every loader its own parse
        gguf.GGUFReader = counting
        try:
            yield counting
        finally:
            gguf.GGUFReader = counted

    with tempfile.TemporaryDirectory() as cache:
        os.environ["DRAFTSMITH_CACHE"] = cache
        source = target_mod.resolve_target(spec)  # the GGUF copied or assembled into this cache: not timed
        digest = target_mod.content_hash(source)
        original = target_mod._each_gguf_parsed_once
        gguf.GGUFReader = counting  # counts the parses the memo makes too
        if not memo:
            target_mod._each_gguf_parsed_once = each_loader_parses
        try:
            t = time.perf_counter()
            out = target_mod.gguf_to_hf_dir(source, digest)
            seconds = time.perf_counter() - t
        finally:
            target_mod._each_gguf_parsed_once = original
            gguf.GGUFReader = counted
        return seconds, len(parses), digest_files(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    import torch
    from gguf import GGUFReader

    from trainer.target import resolve_target

    torch.set_num_threads(args.threads)
    print(f"GGUF conversion, {args.threads} thread(s), {args.repeats} repeat(s) a way")
    for spec in args.targets.split(","):
        t = time.perf_counter()
        GGUFReader(str(resolve_target(spec).path))
        one = time.perf_counter() - t
        runs = {}
        for memo in (False, True):
            got = [convert(spec, memo) for _ in range(args.repeats)]
            runs[memo] = ([s for s, _, _ in got], got[0][1], got[0][2])
        if runs[False][2] != runs[True][2]:
            raise SystemExit(f"{spec}: the two ways wrote different files: {runs[False][2]} vs {runs[True][2]}")
        for memo, label in ((False, "each loader parses"), (True, "parsed once")):
            s, n, _ = runs[memo]
            print(f"{spec:24s} {label:20s} {statistics.median(s):6.1f} s ({min(s):.1f}..{max(s):.1f}), "
                  f"{n} parse(s)")
        ratio = statistics.median(runs[False][0]) / statistics.median(runs[True][0])
        print(f"{spec:24s} one parse {one:.1f} s; parsed once is {ratio:.2f}x faster; files equal (sha256)")


if __name__ == "__main__":
    main()
