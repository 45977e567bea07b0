"""draftsmith's library: the parts the recipes compose. No argv parsing, no printing."""

__version__ = "0.1.0"
