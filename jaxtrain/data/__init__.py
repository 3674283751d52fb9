"""Data: tokenizer (BPE), prepare (corpus -> ArrayRecord shards), pipeline (Grain).

Submodules are imported explicitly (`from jaxtrain.data import pipeline`), so
that the prepare CLI does not pay for importing Grain.
"""
