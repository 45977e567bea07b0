"""Everything that writes someone else's format: vLLM draft folders (export.formats),
Quark FP8 (export.quark), the Hugging Face Hub (export.hub).

`export` imports `trainer` (the draft modules it serializes); `trainer` never imports `export`.
"""
