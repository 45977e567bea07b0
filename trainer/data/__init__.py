"""Chat formatting and loss masks, the capture shard format, draft vocabularies."""
