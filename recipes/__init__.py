"""draftsmith's application layer: one script per stage and the `draftsmith` CLI."""

# `python recipes/train.py` (and `accelerate launch recipes/train.py`) puts this folder first on
# sys.path, where recipes/export.py would shadow the `export` package the recipes import. The
# recipes are modules of this package, never a path root: drop the folder from the path.
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
