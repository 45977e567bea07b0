"""draftsmith's application layer: one script per stage and the `draftsmith` CLI."""
