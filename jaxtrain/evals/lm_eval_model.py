"""lm-eval's model "jaxtrain": a run's checkpoint (`workdir=DIR[,step=N]`) or a Hugging Face directory (`hf=DIR`).

lm-eval 0.4 looks models up in its own registry only (no plugin entry points): importing this module registers the
model for `lm_eval.simple_evaluate(model="jaxtrain", ...)`, and `python -m jaxtrain.evals` is lm-eval's command line
with it registered. Text is tokenized as lm-eval's TemplateLM does (context and continuation split at the token
boundary); an empty context is the prefix token (the tokenizer template's first token, e.g. a BOS, else EOS). The
window is the run's train.seq_len (config.json's max_position_embeddings for hf=), or `max_length=`.
Log-likelihoods: rows sorted by length, `batch_size` of them padded to a power-of-two length (16 up to the window) so
a run compiles a few shapes, each scored in one jitted forward (sum of log_softmax over the continuation; greedy if
every continuation token is the argmax). An input past the window keeps its newest tokens; loglikelihood_rolling
scores lm-eval's disjoint windows of the window's length. generate_until decodes a batch at once with the K/V cache
(jaxtrain.models.rollout.rollout), prompts left-truncated to the window less max_gen_toks, greedy unless the request
samples (temperature, top_k, top_p; seeded by `seed=`); a row stops at EOS or max_gen_toks, and its text is cut at
the first `until` string afterwards. One process, one device.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models import utils as model_utils
from tqdm import tqdm

from jaxtrain import trainer
from jaxtrain.data import layout
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.models import hf as hf_lib
from jaxtrain.models import rollout, transformer
from jaxtrain.models.config import ModelConfig

log = logging.getLogger(__name__)
NAME = "jaxtrain"
MIN_BUCKET = 16  # the shortest padded row length
DEFAULT_BATCH = 16  # rows per call for batch_size=auto


def bucket(n: int, cap: int) -> int:
    """The padded length of a row of `n` tokens: the next power of two from MIN_BUCKET, at most `cap`."""
    return min(cap, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))


@functools.partial(jax.jit, static_argnums=0)
def score(graphdef, params, tokens, segment_ids, targets, weights):
    """tokens, targets [B, T] (targets: the next token), segment_ids [B, T] (1: a token, 0: padding), weights
    [B, T] bool (the positions to score) -> (sum of the scored log-probs [B] f32, every scored target the argmax).
    The f32 logits [B, T, vocab] exist whole: batch_size bounds their memory."""
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = model(tokens, positions, segment_ids).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    log_probs = picked - jax.nn.logsumexp(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1) == targets
    return jnp.where(weights, log_probs, 0.0).sum(-1), jnp.all(greedy | ~weights, axis=-1)


_decode = jax.jit(rollout.rollout, static_argnums=0, static_argnames=("max_new_tokens",))


def load_workdir(workdir, step: int | None = None):
    """(graphdef, params, tokenizer, window) of a run's checkpoint: the newest that verifies, or `step`."""
    config, _, graphdef, params = trainer.restore_params(workdir, step)
    return graphdef, params, layout.load_tokenizer(layout.default_dir(config.data)), config.train.seq_len


def load_hf(hf_dir):
    """(graphdef, params, tokenizer, window) of a Hugging Face directory, in float32 (as `jaxtrain generate --hf`);
    window: config.json's max_position_embeddings, or None."""
    fields, host_params = hf_lib.import_dir(hf_dir)
    graphdef, state = transformer.from_params(ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32"}),
                                              host_params)
    window = json.loads((Path(hf_dir) / hf_lib.CONFIG).read_text()).get("max_position_embeddings")
    window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    return graphdef, jax.device_put(state), tok_lib.load(hf_dir), window


def _batch_size(value) -> int:
    if isinstance(value, str) and value.startswith("auto"):  # no memory probe: a fixed default
        return DEFAULT_BATCH
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {value}")
    return size


@register_model(NAME)
class JaxtrainLM(TemplateLM):
    """The lm-eval LM of a jaxtrain model. `from_model` wraps one already in memory (e.g. during training)."""

    def __init__(self, workdir: str | None = None, hf: str | None = None, step: int | None = None,
                 batch_size: int | str = 1, max_length: int | None = None, max_gen_toks: int = 256, seed: int = 0,
                 device: str | None = None, max_batch_size: int | None = None):
        super().__init__()
        del device, max_batch_size  # lm-eval passes them to every model: one jax device, batch_size rows
        if (workdir is None) == (hf is None):
            raise ValueError("model_args: give workdir=DIR (a jaxtrain run) or hf=DIR (a Hugging Face directory)")
        if hf is not None and step is not None:
            raise ValueError("model_args: step= is a checkpoint step of workdir=; hf= has none")
        step = None if step is None else int(step)
        graphdef, params, tok, window = load_workdir(workdir, step) if workdir is not None else load_hf(hf)
        self._setup(graphdef, params, tok, max_length or window, batch_size, max_gen_toks, seed)
        self._info = {"workdir": workdir, "step": step} if workdir is not None else {"hf": hf}

    @classmethod
    def from_model(cls, graphdef, params, tokenizer: tok_lib.Tokenizer, *, max_length: int, batch_size: int = 1,
                   max_gen_toks: int = 256, seed: int = 0) -> JaxtrainLM:
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(graphdef, params, tokenizer, max_length, batch_size, max_gen_toks, seed)
        lm._info = {}
        return lm

    def _setup(self, graphdef, params, tok, max_length, batch_size, max_gen_toks, seed):
        if not max_length:
            raise ValueError("model_args: max_length= is needed: the model names no window")
        self.graphdef, self.params, self.tok = graphdef, params, tok
        self.max_length, self.batch_size = int(max_length), _batch_size(batch_size)
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        self._template = tok.encode("")  # what encoding adds around any text (a BOS), stripped by tok_encode
        self._calls = 0  # generate_until batches so far: each samples with its own keys

    # --- TemplateLM's interface --------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._template[0] if self._template else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The text's ids; the template's tokens only with add_special_tokens=True (as HFLM encodes by default)."""
        ids = self.tok.encode(string)
        n = len(self._template)
        return ids[n:] if n and not add_special_tokens and ids[:n] == self._template else ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    def get_model_info(self) -> dict:
        return {"jaxtrain": {**self._info, "max_length": self.max_length}}

    # --- Scoring -----------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids) -> (log-prob, greedy) of each continuation."""
        rows, results = [], [(0.0, True)] * len(requests)  # an empty continuation: probability 1
        for i, (_, context, continuation) in enumerate(requests):
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than the model's window "
                                 f"(max_length {self.max_length})")
            if continuation:
                whole = (list(context) + list(continuation))[-(self.max_length + 1):]
                rows.append((i, whole, len(continuation)))
        rows.sort(key=lambda row: -len(row[1]))
        n = self.batch_size
        for start in tqdm(range(0, len(rows), n), desc="jaxtrain loglikelihood", disable=disable_tqdm):
            batch = rows[start:start + n]
            length = bucket(max(len(whole) - 1 for _, whole, _ in batch), self.max_length)
            tokens, segment_ids, targets = (np.zeros((n, length), np.int32) for _ in range(3))
            weights = np.zeros((n, length), bool)
            for r, (_, whole, scored) in enumerate(batch):
                t = len(whole) - 1
                tokens[r, :t], segment_ids[r, :t], targets[r, :t] = whole[:-1], 1, whole[1:]
                weights[r, t - scored:t] = True
            sums, greedy = jax.device_get(score(self.graphdef, self.params, tokens, segment_ids, targets, weights))
            for r, (i, _, _) in enumerate(batch):
                results[i] = (float(sums[r]), bool(greedy[r]))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for r, (text,) in enumerate(req.args for req in requests):
            pairs = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text), context_len=1,
                                                       prefix_token=self.prefix_token_id, max_seq_len=self.max_length)
            for context, continuation in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(r)
        totals = [0.0] * len(requests)
        for r, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[r] += log_prob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- Generation --------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # requests with the same settings decode together
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="jaxtrain generate_until", disable=disable_tqdm)
        for indices in groups.values():
            settings = requests[indices[0]].args[1]
            for i, text in zip(indices, self._generate([requests[i].args[0] for i in indices], settings)):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(1)
        bar.close()
        return out

    def _generate(self, contexts: Sequence[str], settings: dict) -> list[str]:
        kwargs = model_utils.normalize_gen_kwargs(settings, self.max_gen_toks)
        until = model_utils.handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
        new_tokens = kwargs.pop("max_gen_toks")
        room = self.max_length - new_tokens
        if new_tokens < 1 or room < 1:
            raise ValueError(f"max_gen_toks: {new_tokens} must be in 1..{self.max_length - 1} (the model's window "
                             f"max_length {self.max_length} also holds the prompt)")
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        top_k, top_p = int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0)
        if ignored := sorted(set(kwargs) - {"do_sample", "temperature", "top_k", "top_p"}):
            lm_utils.warning_once(log, f"jaxtrain: generation settings not applied: {ignored}")
        prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-room:] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts, n = [""] * len(prompts), self.batch_size
        for start in range(0, len(order), n):
            batch = order[start:start + n]
            width = bucket(max(len(prompts[i]) for i in batch), room)
            tokens, left_pad = np.zeros((n, width), np.int32), np.full(n, width - 1, np.int32)
            for r, i in enumerate(batch):
                tokens[r, width - len(prompts[i]):] = prompts[i]
                left_pad[r] = width - len(prompts[i])
            active = np.arange(n) < len(batch)
            ids, _ = jax.device_get(_decode(
                self.graphdef, self.params, tokens, left_pad, active, np.uint32(self.seed), np.uint32(self._calls),
                np.float32(temperature), np.int32(top_k), np.float32(top_p), rollout.stop_array([self.eot_token_id]),
                max_new_tokens=new_tokens))
            self._calls += 1
            for r, i in enumerate(batch):
                row = [int(t) for t in ids[r] if t >= 0]
                row = row[:row.index(self.eot_token_id)] if self.eot_token_id in row else row
                texts[i] = model_utils.postprocess_generated_text(self.tok_decode(row), until, None)
        return texts


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (the arguments `lm_eval` takes; default sys.argv[1:]) with this model registered."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *(saved[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
