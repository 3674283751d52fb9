"""jaxtrain: LLM training on a named device mesh (README.md; the layers: docs/architecture.md)."""

from jaxtrain import moved as _moved

_moved.install()
