"""Model families. Only the dense Llama-style decoder exists so far."""
from jaxtrain.models.transformer import ModelConfig, Transformer, build, matmul_params, train_flops_per_token

__all__ = ["ModelConfig", "Transformer", "build", "matmul_params", "train_flops_per_token"]
