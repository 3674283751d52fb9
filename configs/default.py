"""CPU quickstart: a ~4M-parameter Llama-style model on the KJV Bible, about 2 minutes on 2 cores."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/default"
    return c
