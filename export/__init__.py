"""Everything that writes someone else's format: vLLM dirs, Quark FP8, Hub upload."""
