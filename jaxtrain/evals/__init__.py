"""Evaluation harness adapters: `lm_eval_model` is lm-eval's model "jaxtrain" (`python -m jaxtrain.evals`)."""
