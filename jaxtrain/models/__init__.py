"""Models: one decoder (transformer.py) built from shared blocks (layers.py, attention.py, moe.py), configured by
`config.ModelConfig`; the fused loss (cross_entropy.py); decoding (sampling.py); Hugging Face weights (hf.py)."""
