"""Data: the prepared-dir format (layout), tokenizers, sources, the writers (corpus, prepare) and the reader (pipeline).

Submodules are imported explicitly (`from jaxtrain.data import pipeline`), so that preparing data does not pay
for importing Grain.
"""
