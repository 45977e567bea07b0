"""Chat formatting and loss masks, the capture shard format and the online wire format beside it, draft
vocabularies."""
