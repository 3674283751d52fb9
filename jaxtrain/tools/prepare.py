"""`jaxtrain prepare`: text as tokenized ArrayRecord shards in a data dir (`jaxtrain.data.prepare`).

Usage:
  jaxtrain prepare --output DIR --vocab_size 8192            # the default corpus (KJV)
  jaxtrain prepare --input 'docs/*.jsonl' --field text --output DIR [--tokenizer tokenizer.json|HF_MODEL_DIR]
  jaxtrain prepare --input hf:json:'docs/*.jsonl' tfds:my_corpus:1.0.0 --output DIR
"""

from __future__ import annotations

from jaxtrain.data import prepare, sources
from jaxtrain.tools import common


def _prepare(argv) -> int:
    parser = common.Parser(prog="jaxtrain prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="data dir to create, finish or reuse")
    parser.add_argument("--vocab_size", type=int, default=8192, help="of the BPE trained when no --tokenizer is given")
    parser.add_argument("--heldout_docs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input", nargs="+", action="extend",
                        help="files or globs (.txt, .jsonl[.gz], .parquet; epath: gs:// works with gcsfs), "
                        "hf:SAVED_DIR, hf:BUILDER:FILES (json/csv/parquet/text), hf:DIR, tfds:NAME[/CONFIG][:VERSION] "
                        "or tfds:BUILDER_DIR; without it the default corpus (KJV) is prepared")
    parser.add_argument("--format", choices=sources.KINDS, help="kind of every file input (default: by extension)")
    parser.add_argument("--field", default="text", help="JSONL key / Parquet or dataset column holding the text")
    parser.add_argument("--text_split", choices=sources.TEXT_SPLITS, default="file",
                        help="a .txt document is the whole file, each blank-line paragraph, or each line")
    parser.add_argument("--split", default="train", help="split of hf:/tfds: inputs (tfds slicing works)")
    parser.add_argument("--tfds_data_dir", help="where tfds: datasets are prepared (default: TFDS's)")
    parser.add_argument("--tokenizer", help="an HF tokenizer.json, a SentencePiece .model, or a Hugging Face model "
                        "directory (its tokenizer.json and tokenizer_config.json: its EOS, and BOS if its "
                        "tokenizer adds one) to use instead of training a BPE")
    parser.add_argument("--eos_token", help="the given tokenizer's end-of-document token (default: a directory's "
                        "eos_token, else found by name)")
    parser.add_argument("--num_shards", type=int, help="train shards (default: one per ~256 MB of text)")
    parser.add_argument("--workers", type=int, help="tokenizing processes (default: one per CPU)")
    args = parser.parse_args(argv)
    if args.input:
        prepare.prepare_sources(args.output, args.input, fmt=args.format, field=args.field,
                                text_split=args.text_split, tokenizer=args.tokenizer, eos_token=args.eos_token,
                                vocab_size=args.vocab_size, heldout_docs=args.heldout_docs, seed=args.seed,
                                num_shards=args.num_shards, workers=args.workers, split=args.split,
                                tfds_data_dir=args.tfds_data_dir)
    else:
        prepare.prepare_default_corpus(args.output, args.vocab_size, args.heldout_docs, args.seed)
    return 0


def main(argv: list[str] | None = None) -> int:
    return common.run(_prepare, argv)
