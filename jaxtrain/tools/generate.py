"""`jaxtrain generate --workdir DIR --prompt TEXT`: text from a trained run's checkpoint.

Usage:
  jaxtrain generate --workdir DIR --prompt "And God said" [--max_new_tokens 64] [--temperature 0.8]
      [--top_k 40] [--top_p 1.0] [--seed 0] [--num_samples 1] [--step N]

Exit codes: 0 done; 2 bad input (one line on stderr naming the flag or path). How sampling works:
`jaxtrain.models.sampling`.
"""

from __future__ import annotations

import os
import sys

from jaxtrain import trainer
from jaxtrain.data import layout
from jaxtrain.errors import CheckpointError
from jaxtrain.models import sampling
from jaxtrain.tools import common


def _parse(argv):
    parser = common.Parser(prog="jaxtrain generate", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a training run's workdir")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=40, help="0: off")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_samples", type=int, default=1, help="continuations of the prompt, drawn together")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest that verifies)")
    args = parser.parse_args(argv)
    try:
        sampling.check_settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, num_samples=args.num_samples)
    except ValueError as e:
        parser.error(f"--{e}")
    if not args.prompt:
        parser.error("--prompt: empty; the model needs at least one token to continue")
    if not os.path.isdir(args.workdir):
        parser.error(f"--workdir: {args.workdir} does not exist")
    return args


def _generate(argv) -> int:
    args = _parse(argv)
    common.quiet_orbax()
    tok = layout.load_tokenizer(layout.default_dir(trainer.load_config(args.workdir).data))
    config, _, graphdef, params = trainer.restore_params(args.workdir, args.step)
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        print("error: --prompt: encodes to no tokens", file=sys.stderr)
        return 2
    samples = sampling.generate(graphdef, params, prompt_ids, window=config.train.seq_len,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop_id=tok.eos_id, num_samples=args.num_samples)
    for i, ids in enumerate(samples):
        if len(samples) > 1:
            print(f"--- sample {i}")
        print(args.prompt + tok.decode(ids))
    return 0


def main(argv: list[str] | None = None) -> int:
    # No checkpoint (or not that step) is bad input for this command, not a failed write.
    return common.run(_generate, argv, bad_input=(CheckpointError,))
