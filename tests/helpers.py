"""Small helpers shared by test modules (tests/ is on sys.path under pytest's default import mode)."""

import hashlib
import json
import os
from pathlib import Path

# XLA:CPU's LLVM optimizations are most of a tiny test program's compile time and buy nothing at its size; the
# optimized HLO that tests inspect does not change. Every jax process of the suite gets it: conftest.py, and
# `cpu_flags` where a test's subprocess sets XLA_FLAGS of its own.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess: `devices` simulated CPU devices, compiled as the suite compiles."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def tree_digest(directory):
    """{relative path: sha256} of every file under directory, but a workdir's lock file, which names the last run
    to hold it (jaxtrain/workdir.py)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            if name == ".lock" and root == str(directory):
                continue
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def install_poison(setattr_fn, bad_step: int, only_process: int | None = None):
    """Makes the batch of `bad_step` turn the loss (and every gradient) NaN, as a corrupt record would.

    The marker is a position of -1 in the batch (on `only_process`'s rows only, if given); objectives.loss_terms
    turns it into NaN inside the jitted step. `setattr_fn` is pytest's monkeypatch.setattr, or plain setattr in a
    subprocess."""
    import jax
    import jax.numpy as jnp

    from jaxtrain import objectives
    from jaxtrain.data import pipeline

    original_next, original_loss = pipeline.TrainIterator.__next__, objectives.loss_terms

    def poisoned_next(self):
        bad = self.next_token == (bad_step - 1) * self.global_batch * self.seq_len
        batch = original_next(self)
        if bad and only_process in (None, jax.process_index()):
            batch = {**batch, "positions": batch["positions"].copy()}
            batch["positions"][0, 0] = -1
        return batch

    def poisoned_loss(graphdef, params, batch):
        total, count, aux = original_loss(graphdef, params, batch)
        return total * jnp.where(jnp.any(batch["positions"] < 0), jnp.nan, 1.0), count, aux

    setattr_fn(pipeline.TrainIterator, "__next__", poisoned_next)
    setattr_fn(objectives, "loss_terms", poisoned_loss)


def train_on_stream(trainer, data_dir, steps: int, seq_len: int = 32, batch: int = 8):
    """(held-out loss before, after, [(loss, grad norm) per step]) of `steps` train steps from the seed's init on
    the first batches of `data_dir`'s stream: a run's numbers without its workdir, checkpoints or evals."""
    import numpy as np

    from jaxtrain import trainer as trainer_lib
    from jaxtrain.data import pipeline

    stream = pipeline.train_iterator(data_dir, seq_len=seq_len, global_batch=batch, seed=0)
    held_out = list(pipeline.eval_batches(data_dir, seq_len=seq_len, global_batch=batch, num_batches=2))
    state = trainer.init()
    before, history = trainer.evaluate(state["params"], held_out, state.get("reference")), []
    for _ in range(steps):
        state, m = trainer.train_step(state, trainer_lib.global_batch(next(stream), trainer.batch_sharding))
        history.append((float(m["loss"]), float(m["grad_norm"])))
    return before, trainer.evaluate(state["params"], held_out, state.get("reference")), np.array(history)


def step_history(trainer, data_dir, steps: int, seq_len: int = 32, batch: int = 8):
    """[(loss, grad norm) per step] of `steps` train steps from the seed's init on the first batches of `data_dir`'s
    stream, with no eval (an eval step is another compile): the sharded side of a comparison."""
    import numpy as np

    from jaxtrain import trainer as trainer_lib
    from jaxtrain.data import pipeline

    stream = pipeline.train_iterator(data_dir, seq_len=seq_len, global_batch=batch, seed=0)
    state, history = trainer.init(), []
    for _ in range(steps):
        state, m = trainer.train_step(state, trainer_lib.global_batch(next(stream), trainer.batch_sharding))
        history.append((float(m["loss"]), float(m["grad_norm"])))
    stream.close()
    return np.array(history)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer_dir(path, words):
    """A tiny Hugging Face tokenizer directory (byte-level BPE over `words`) with a ChatML template and
    <|im_end|> as its EOS: chat data for tests, made here, nothing downloaded."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([" ".join(words) * 20, "user assistant system say\n"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def trainer_on(cfg, mesh_shape: dict, rules: dict, devices=None):
    """trainer.build_trainer for `cfg` on a mesh of the test's choosing (e.g. one device, as the reference of a
    sharded run), with config.resolve in place of validate's checks of the config's own mesh."""
    from jaxtrain import config as config_lib
    from jaxtrain import trainer as trainer_lib

    return trainer_lib.build_trainer(cfg, config_lib.resolve(cfg, mesh_shape, rules), devices=devices)


def numpy_model(cfg, seed: int = 0):
    """(graphdef, params) of transformer.build(cfg) with every parameter drawn by numpy: N(0, init_std), norm
    scales N(1, init_std). No initializer compiles, and no norm scale is exactly 1 (which would leave norms
    untested)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxtrain.models import transformer

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: transformer.build(cfg, seed=seed)))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        mean = 1.0 if str(getattr(path[-1], "key", path[-1])) == "scale" else 0.0
        return jnp.asarray(rng.normal(mean, cfg.init_std, x.shape), x.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(abstract))


def init_params(cfg, seed: int = 0):
    """transformer.build(cfg, seed)'s params (a pure dict) from one compiled program, without LLVM's optimizations
    (it runs once), as the trainer's init is compiled: built op by op, each of its initializers compiles a
    program of its own, about 24 for a tiny model (seconds each time a test meets a new shape)."""
    import jax
    from flax import nnx

    from jaxtrain.models import transformer

    init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(transformer.build(cfg, seed))))
    return init.lower().compile(compiler_options={"xla_backend_optimization_level": 0})()
