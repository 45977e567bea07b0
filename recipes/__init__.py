"""draftsmith's application layer: one script per stage and the `draftsmith` CLI.

Each stage runs as `python recipes/<stage>.py`, `accelerate launch recipes/<stage>.py` or
`draftsmith <stage>`. Running a file by path puts this folder first on sys.path, so no file here
is named like a package the recipes import (tests/test_layout.py holds that).
"""
