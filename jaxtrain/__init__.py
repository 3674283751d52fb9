"""jaxtrain: LLM training on a named device mesh (README.md)."""

from jaxtrain import host_memory

# Before jax starts its threads: see jaxtrain/host_memory.py (CPU runs only; JAXTRAIN_KEEP_FREED_MEMORY=0 to skip).
host_memory.keep_freed_memory()
