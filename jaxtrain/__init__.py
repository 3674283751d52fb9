"""jaxtrain: LLM training on a named device mesh (README.md)."""
