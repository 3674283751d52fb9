"""`jaxtrain generate`: text (or token ids) from a training run's checkpoint or a Hugging Face model directory.

Usage:
  jaxtrain generate --workdir DIR --prompt "And God said" [--max_new_tokens 64] [--temperature 0.8]
      [--top_k 40] [--top_p 1.0] [--seed 0] [--num_samples 1] [--step N]
  jaxtrain generate --hf MODEL_DIR (--prompt TEXT | --prompt_ids 1,2,3) [the same sampling flags]
  jaxtrain generate (--workdir DIR | --hf MODEL_DIR) --chat --prompt "a user message"

--hf runs the directory's weights (`jaxtrain.models.hf.import_dir`) in float32, encoding --prompt with its own
tokenizer as transformers' AutoTokenizer does, and stops as transformers' `generate` does: at
generation_config.json's eos_token_id (else config.json's), and with --prompt at the tokenizer's EOS too; its
window is config.json's max_position_embeddings. --prompt_ids prints each sample's new ids comma-separated (a stop id
included). --chat sends --prompt as a user message through the chat template (the HF directory's, or the one a
workdir's chat data was prepared with) and prints the reply alone. Exit codes: 0 done; 2 bad input (one line on
stderr naming the flag or path). How sampling works: `jaxtrain.models.sampling`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax

from jaxtrain import compat, memory, trainer
from jaxtrain.data import chat, layout
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import CheckpointError, HFError, TokenizerError
from jaxtrain.models import hf, sampling, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.tools import common


def _parse(argv):
    parser = common.Parser(prog="jaxtrain generate", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training run's workdir")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--prompt_ids", help="token ids to continue, e.g. 1,2,3; prints the new ids")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=40, help="0: off")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_samples", type=int, default=1, help="continuations of the prompt, drawn together")
    parser.add_argument("--step", type=int, help="checkpoint step of --workdir (default: the newest that verifies)")
    parser.add_argument("--chat", action="store_true", help="--prompt is a user message: apply the chat template "
                        "and print the reply")
    args = parser.parse_args(argv)
    if args.chat and args.prompt is None:
        parser.error("--chat: needs --prompt (a user message)")
    try:
        sampling.check_settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, num_samples=args.num_samples)
    except ValueError as e:
        parser.error(f"--{e}")
    if args.prompt is not None and not args.prompt:
        parser.error("--prompt: empty; the model needs at least one token to continue")
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            ids = []
        if not ids or min(ids) < 0:
            parser.error(f"--prompt_ids: {args.prompt_ids!r}: expected token ids (integers >= 0) joined by commas, "
                         f"e.g. 1,2,3")
        args.prompt_ids = ids
    if args.hf is not None and args.step is not None:
        parser.error("--step: a checkpoint step of --workdir; --hf has none")
    flag, path = ("--workdir", args.workdir) if args.workdir is not None else ("--hf", args.hf)
    if not os.path.isdir(path):
        parser.error(f"{flag}: {path} {'is not a directory' if os.path.exists(path) else 'does not exist'}")
    return args


def _from_workdir(args):
    """(model config, graphdef, params, window, tokenizer, stop ids) of a workdir's checkpoint."""
    tok = layout.load_tokenizer(layout.default_dir(trainer.load_config(args.workdir).data))
    config, model_cfg, graphdef, params = trainer.restore_params(args.workdir, args.step)
    return model_cfg, graphdef, params, config.train.seq_len, tok, [tok.eos_id]


def _eos_ids(hf_dir: Path, config: dict) -> list[int]:
    # transformers' generate stops at its generation config's eos_token_id, made from config.json without one.
    gen_path = hf_dir / "generation_config.json"
    try:
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    except (OSError, ValueError) as e:
        raise HFError(f"{gen_path}: not readable JSON ({e})") from None
    source, eos = (gen_path, gen["eos_token_id"]) if "eos_token_id" in gen else (hf_dir / hf.CONFIG,
                                                                                  config.get("eos_token_id"))
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
        raise HFError(f"{source}: eos_token_id: {json.dumps(eos)}; expected token ids")
    return eos


def _from_hf(args):
    """(model config, graphdef, params, window, tokenizer or None, stop ids) of a Hugging Face directory."""
    hf_dir = Path(args.hf)
    hf.read_config(hf_dir)  # not an HF directory, or an unsupported model: said before anything loads
    config = json.loads((hf_dir / hf.CONFIG).read_text())
    tok = None
    if args.prompt is not None:
        if not (hf_dir / tok_lib.HF_TOKENIZER).is_file():
            raise TokenizerError(f"{hf_dir / tok_lib.HF_TOKENIZER}: not found, so --prompt cannot be encoded; "
                                 f"pass token ids with --prompt_ids")
        tok = tok_lib.load(hf_dir)
    fields, host_params = hf.import_dir(hf_dir)
    cfg = ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32"})
    graphdef, state = transformer.from_params(cfg, host_params)
    stops = _eos_ids(hf_dir, config) + ([tok.eos_id] if tok is not None else [])
    window = config.get("max_position_embeddings")
    window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    return cfg, graphdef, jax.device_put(state), window, tok, sorted(set(stops))


def _chat_template(args) -> tuple[str, dict]:
    """(template, its variables) for --chat: the HF directory's, or the one a workdir's chat data was rendered with."""
    source = args.hf if args.hf is not None else layout.default_dir(trainer.load_config(args.workdir).data)
    return chat.load_template(source), chat.special_tokens(source)


def _decode_bytes(cfg, num_samples: int, cache_len: int) -> int:
    """A floor under decoding's memory beyond the weights: the K/V cache of `num_samples` rows and their f32
    logits (what a request for many samples grows)."""
    cache = jax.eval_shape(lambda: transformer.init_cache(cfg, num_samples, cache_len))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) + num_samples * cfg.vocab_size * 4


def _generate(argv) -> int:
    args = _parse(argv)
    common.quiet_orbax()
    template = _chat_template(args) if args.chat else None  # a missing template is said before the weights load
    model_cfg, graphdef, params, window, tok, stops = (_from_hf if args.hf is not None else _from_workdir)(args)
    vocab_size = model_cfg.vocab_size
    if args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
        if outside := [i for i in prompt_ids if i >= vocab_size]:
            print(f"error: --prompt_ids: {outside[0]} is not a token id of the model (vocab_size {vocab_size})",
                  file=sys.stderr)
            return 2
    elif template is not None:
        prompt_ids = chat.encode_prompt(tok, template[0], [{"role": "user", "content": args.prompt}], template[1])
    else:
        prompt_ids = tok.encode(args.prompt)
        if not prompt_ids:
            print("error: --prompt: encodes to no tokens", file=sys.stderr)
            return 2
    window = window or len(prompt_ids) + args.max_new_tokens
    need = _decode_bytes(model_cfg, args.num_samples,
                         sampling.cache_length(len(prompt_ids), args.max_new_tokens, window))
    if (have := memory.device_bytes(jax.local_devices()[:1])) and need > have:
        gib = 2**30
        print(f"error: --num_samples: {args.num_samples} samples of up to {len(prompt_ids) + args.max_new_tokens} "
              f"tokens need at least {need / gib:,.1f} GiB for their K/V cache, over the {have / gib:,.1f} GiB the "
              f"device has; ask for fewer samples or new tokens", file=sys.stderr)
        return 2
    samples = sampling.generate(graphdef, params, prompt_ids, window=window,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop_id=stops, num_samples=args.num_samples,
                                keep_stop=args.prompt_ids is not None)
    for i, ids in enumerate(samples):
        if len(samples) > 1:
            print(f"--- sample {i}")
        if args.prompt_ids is not None:
            print(",".join(map(str, ids)))
        else:
            print(tok.decode(ids) if args.chat else args.prompt + tok.decode(ids))
    return 0


def main(argv: list[str] | None = None) -> int:
    compat.install()  # it restores checkpoints: Orbax's workarounds, s3:// (jaxtrain.compat)
    # No checkpoint (or not that step) is bad input for this command, not a failed write. HFError and
    # TokenizerError are bad input everywhere (jaxtrain.errors).
    return common.run(_generate, argv, bad_input=(CheckpointError,))
