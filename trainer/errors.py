"""Errors that carry one clear line for the user (what file/record/key, what to do).

Recipes catch `DraftsmithError`, print its message on one line and exit non-zero;
anything else is a bug and keeps its traceback.
"""


class DraftsmithError(Exception):
    """A user-facing error: `str(err)` is the whole message, one line."""


class ConfigError(DraftsmithError):
    pass


class DataError(DraftsmithError):
    pass


class TargetError(DraftsmithError):
    pass
