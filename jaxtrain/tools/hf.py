"""`jaxtrain hf`: a run's checkpoint out as its family's Hugging Face directory, and the flags that start from one.

Usage:
  jaxtrain hf export --workdir W --output D [--step N] [--dtype float32|bfloat16] [--overwrite]
  jaxtrain hf export --workdir W --output D --adapters   # a LoRA run's adapters alone, in PEFT's format
  jaxtrain hf overrides D     # the --config.model.* flags that fine-tune from D

The weight mapping: `jaxtrain.models.hf`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from jaxtrain import compat, trainer
from jaxtrain.data import layout
from jaxtrain.errors import CheckpointError
from jaxtrain.models import hf
from jaxtrain.tools import common


def _parse(argv):
    parser = common.Parser(prog="jaxtrain hf", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=common.Parser)
    export = commands.add_parser("export", help="write a workdir's checkpoint as a Hugging Face directory "
                                                     "(the family of model.family)")
    export.add_argument("--workdir", required=True)
    export.add_argument("--output", required=True, help="directory to create (written whole, then renamed)")
    export.add_argument("--step", type=int, help="checkpoint step (default: the newest that verifies)")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), help="of the weights (default: as trained)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing export at --output")
    export.add_argument("--adapters", action="store_true", help="a LoRA run: the adapters alone, as PEFT writes "
                        "them (adapter_config.json + adapter_model.safetensors); without it, the merged model")
    overrides = commands.add_parser("overrides", help="print the jaxtrain flags that fine-tune from an HF dir")
    overrides.add_argument("hf_dir")
    return parser.parse_args(argv)


def _hf(argv) -> int:
    args = _parse(argv)
    if args.command == "overrides":
        print(" ".join(shlex.quote(f) for f in hf.override_flags(args.hf_dir)))
        return 0
    hf.check_output(Path(args.output), args.overwrite)  # before a possibly long restore
    common.quiet_orbax()
    config, model_cfg, _, params = trainer.restore_params(args.workdir, args.step)
    if args.adapters:
        out = hf.export_adapters(params, model_cfg, args.output, base_model=config.model.init_from,
                                 overwrite=args.overwrite)
        print(f"exported the LoRA adapters of {args.workdir} as {out}")
        return 0
    out = hf.export(params, model_cfg, args.output, dtype=args.dtype,
                          tokenizer_dir=layout.default_dir(config.data),
                          max_position_embeddings=config.train.seq_len, overwrite=args.overwrite)
    print(f"exported {args.workdir} as {out} ({args.dtype or model_cfg.param_dtype})")
    return 0


def main(argv: list[str] | None = None) -> int:
    compat.install()  # it restores checkpoints: Orbax's workarounds, s3:// (jaxtrain.compat)
    # No checkpoint, or not that step: bad input for this command.
    return common.run(_hf, argv, bad_input=(CheckpointError,))
