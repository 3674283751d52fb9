"""`python -m jaxtrain.evals --model jaxtrain --model_args workdir=DIR --tasks ...`: lm-eval's own command line (every
flag as `lm_eval` takes it) with jaxtrain's model registered (jaxtrain.evals.lm_eval_model)."""

from absl import logging

from jaxtrain import compat
from jaxtrain.evals import lm_eval_model

if __name__ == "__main__":
    compat.install()  # it restores checkpoints: Orbax's workarounds, s3:// (jaxtrain.compat)
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file operation at INFO
    lm_eval_model.main()
