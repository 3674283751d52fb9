"""CI runs the notebooks (`pytest --nbmake notebooks`) at tiny sizes in a throwaway workdir.

The kernel nbmake starts inherits this process's environment, which is how the sizes reach it."""

import os
import tempfile

os.environ.setdefault("QUICKSTART_TINY", "1")
os.environ.setdefault("QUICKSTART_STEPS", "20")
os.environ.setdefault("QUICKSTART_NEW_TOKENS", "16")
os.environ.setdefault("QUICKSTART_WORKDIR", os.path.join(tempfile.mkdtemp(prefix="quickstart_"), "run"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("FINETUNE_TINY", "1")
os.environ.setdefault("FINETUNE_STEPS", "4")
os.environ.setdefault("FINETUNE_PRETRAIN_STEPS", "4")
os.environ.setdefault("FINETUNE_EXAMPLES", "200")
os.environ.setdefault("FINETUNE_NEW_TOKENS", "8")
os.environ.setdefault("FINETUNE_ROOT", tempfile.mkdtemp(prefix="fine_tune_"))
os.environ.setdefault("RL_SFT_STEPS", "20")
os.environ.setdefault("RL_STEPS", "6")
os.environ.setdefault("RL_ROOT", tempfile.mkdtemp(prefix="rl_"))
