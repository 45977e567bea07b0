"""Atomic writes and the files that make every output folder explain itself."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from safetensors.torch import save

from trainer.errors import DraftsmithError

PROVENANCE_PACKAGES = ("draftsmith", "torch", "transformers", "accelerate", "datasets", "safetensors",
                       "huggingface_hub", "deepspeed", "amd-quark")


def cache_root() -> Path:
    """draftsmith's cache ($DRAFTSMITH_CACHE, else ~/.cache/draftsmith): targets converted from
    GGUF, vLLM's cache, regeneration work, the servability answer."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual mode (a server may read them)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    atomic_write_bytes(path, save(tensors, metadata=metadata))


def ensure_dir(path: str | Path, what: str = "output_dir") -> Path:
    """mkdir -p, or one line when the path cannot be a folder (a regular file in the way, no permission)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), path)
        raise DraftsmithError(f"{what} '{path}' cannot be created: '{blocker}' is a file, not a folder; "
                              "choose another path") from None
    except OSError as err:
        raise DraftsmithError(f"{what} '{path}' cannot be created: {err.strerror}; choose another path") from None
    return path


# What each stage's output folder holds, besides provenance.json's "stage" (folders written
# before it was recorded are known by these files).
STAGE_MARKERS = {"prepare": ("summary.json",), "capture": ("capture_state.json", "manifest.json"),
                 "export": ("draftsmith_export.json",), "train": ("train_report.json", "checkpoints"),
                 "eval": ("report.json",)}  # a demo folder is known only by its mark (claim_output)


STAGE_FILE = ".draftsmith-stage"  # written when a long stage starts writing into its folder


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc/PID/stat's starttime, in clock ticks since boot), so
    that a pid the system reused is not taken for the run that wrote a mark; None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def claim_output(folder: Path, stage: str) -> None:
    """Mark `folder` as `stage`'s output when the stage starts writing into it (capture, train:
    they write in place and can be killed before provenance.json exists), so that overwrite=true
    may replace the folder a killed run left, and with the writing process (host, pid and its
    start), so that no other run replaces or writes into it while that process lives."""
    atomic_write_json(Path(folder) / STAGE_FILE, {"stage": stage, "host": platform.node(), "pid": os.getpid(),
                                                  "pid_start": _process_start(os.getpid())})


def _mark(folder: Path) -> dict:
    """The mark claim_output left: {"stage", "host", "pid", "pid_start"} (an older mark: the stage alone)."""
    try:
        text = (Path(folder) / STAGE_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    try:
        mark = json.loads(text)
    except ValueError:
        return {"stage": text.strip() or None}
    return mark if isinstance(mark, dict) else {}


def writer_alive(folder: Path) -> int | None:
    """The pid of another process on this host still writing into `folder` (its mark names it and it
    runs, started when the mark says), else None."""
    mark = _mark(folder)
    pid = mark.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or mark.get("host") != platform.node():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: it lives
        pass
    start = _process_start(pid)
    return pid if start is None or mark.get("pid_start") in (None, start) else None


def stage_of(folder: Path) -> str | None:
    """The draftsmith stage that wrote `folder` (its provenance.json says, or the mark a running
    stage leaves; older folders are known by their files), or None: not a draftsmith output."""
    folder = Path(folder)
    try:
        stage = json.loads((folder / "provenance.json").read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        stage = None
    if not stage:
        stage = _mark(folder).get("stage")
    if stage:
        return stage
    for name, files in STAGE_MARKERS.items():
        if any((folder / f).exists() for f in files) and (folder / "provenance.json").is_file():
            return name
    return None


def guard_output(out: str | Path, inputs, stage: str, overwrite: bool, allow_inside=()) -> Path:
    """The one rule every stage's output folder obeys, before any work: it is never, contains,
    or sits inside an input of the run (symlinks resolved), so no stage can delete or rewrite
    what it reads; and an existing, non-empty one is replaced (`overwrite`) only when draftsmith
    wrote it for the same stage. `allow_inside`: inputs the output may sit inside (eval's report
    folder within the export it measures, which records it). One line naming both paths."""
    out = Path(out).expanduser()  # as every input is: `~` means one place on both sides
    target = out.resolve()
    for given in inputs:
        if given is None:
            continue
        p = Path(given).expanduser()
        try:
            if not p.exists():
                continue
        except OSError:  # a name no file can have (too long): not an input on disk
            continue
        src = p.resolve()
        inside_allowed = any(Path(a).resolve() == src for a in allow_inside) and target != src \
            and target.is_relative_to(src)
        if target == src or src.is_relative_to(target) or (target.is_relative_to(src) and not inside_allowed):
            how = "is" if target == src else "contains" if src.is_relative_to(target) else "sits inside"
            raise DraftsmithError(f"{stage}: output_dir '{out}' {how} an input of this run ('{given}'); writing there "
                                  "could destroy it: choose another output_dir")
    if out.is_dir() and any(out.iterdir()):
        running = writer_alive(out) if os.environ.get("RANK", "0") == "0" else None  # ranks > 0: their rank 0's mark
        if running is not None:
            raise DraftsmithError(f"{stage}: output_dir '{out}' is being written by a running draftsmith "
                                  f"{_mark(out).get('stage')} (pid {running}); wait for it to end, or choose another "
                                  "output_dir")
        wrote = stage_of(out)
        if overwrite and wrote != stage:
            raise DraftsmithError(f"{stage}: output_dir '{out}' exists and was not written by draftsmith {stage}"
                                  + (f" (it holds a {wrote} output)" if wrote else "")
                                  + "; overwrite only replaces a folder of its own stage: choose another output_dir")
    elif out.exists() and not out.is_dir():
        raise DraftsmithError(f"{stage}: output_dir '{out}' is a file, not a folder; choose another output_dir")
    return out


def fresh_output_dir(path: str | Path, overwrite: bool, what: str = "output_dir") -> Path:
    """A temp sibling of `path` to build into; `publish_dir` renames it into place.

    An existing `path` is an error unless `overwrite`, so nothing is lost or half-written.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise DraftsmithError(f"{what} '{path}' already exists; pass overwrite=true (or --overwrite) to replace it")
    ensure_dir(path.parent, what)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as err:
        raise DraftsmithError(f"{what} '{path}' cannot be written: {err.strerror} in '{path.parent}'; choose a folder "
                              "you can write to") from None
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the published folder gets the usual mode
    return tmp


def publish_dir(tmp: Path, path: str | Path) -> None:
    path = Path(path)
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def disk_free(path: str | Path) -> int:
    """Free bytes on the filesystem `path` is (or would be) on: its nearest existing folder's."""
    p = Path(path).expanduser().resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def human_bytes(n: float) -> str:
    """1.50 GiB, 12.3 MiB, 64.0 KiB, 512 B: never '0.00 GiB' for what is small but not nothing."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def check_space(path: str | Path, need: float, what: str, advice: str = "choose another output_dir") -> None:
    """Refuse, before the work, to write `need` bytes where fewer are free: one line naming what
    would be written, both sizes and what to do."""
    free = disk_free(path)
    if need > free:
        raise DraftsmithError(f"{what} needs {human_bytes(need)}, but the filesystem of '{path}' has "
                              f"{human_bytes(free)} free; free space, or {advice}")


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_run_files(out_dir: Path, cfg_yaml: str, extra: dict[str, Any], argv: list[str] | None = None,
                    stage: str | None = None) -> None:
    """config.yaml, command.txt and provenance.json: enough to reproduce the folder (and, in
    provenance.json, which stage wrote it: `guard_output` lets overwrite replace only that)."""
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "config.yaml", cfg_yaml)
    command = " ".join([Path(sys.argv[0]).name if argv is None else "", *(sys.argv[1:] if argv is None else argv)])
    atomic_write_text(out_dir / "command.txt", command.strip() + "\n")
    atomic_write_json(out_dir / "provenance.json", {"stage": stage, "git_commit": git_commit(),
                                                    "versions": package_versions(), **extra})
