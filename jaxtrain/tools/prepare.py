"""`jaxtrain prepare`: text as tokenized ArrayRecord shards in a data dir (`jaxtrain.data.prepare`).

Usage:
  jaxtrain prepare --output DIR --vocab_size 8192            # the default corpus (KJV)
  jaxtrain prepare --input 'docs/*.jsonl' --field text --output DIR [--tokenizer tokenizer.json|HF_MODEL_DIR]
  jaxtrain prepare --input hf:json:'docs/*.jsonl' tfds:my_corpus:1.0.0 --output DIR
  jaxtrain prepare --chat --input chats.jsonl --tokenizer HF_MODEL_DIR --max_len 2048 --output DIR
  jaxtrain prepare --preference --input pairs.jsonl --tokenizer HF_MODEL_DIR --max_len 4096 --output DIR
  jaxtrain prepare --prompts --input prompts.jsonl --tokenizer HF_MODEL_DIR --heldout_prompts 100 --output DIR
  jaxtrain prepare --input 'docs/*.jsonl' --output gs://BUCKET/DIR    # prepared locally, then uploaded
  jaxtrain prepare --input 'docs/*.jsonl' --output DIR --runner DirectRunner   # the shards on Apache Beam
"""

from __future__ import annotations

from jaxtrain import compat, storage
from jaxtrain.data import corpus, encode, prepare, prompts, sources, writer
from jaxtrain.tools import common


def _prepare(argv) -> int:
    parser = common.Parser(prog="jaxtrain prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="data dir to create, finish or reuse (a local path, gs:// "
                        "or s3://)")
    parser.add_argument("--staging", help="with a gs:// or s3:// --output: the local dir it is prepared (and "
                        "resumed) in before the upload (default: under ~/.cache/jaxtrain/staging)")
    parser.add_argument("--vocab_size", type=int, default=8192, help="of the BPE trained when no --tokenizer is given")
    parser.add_argument("--heldout_docs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input", nargs="+", action="extend",
                        help="files or globs (.txt, .jsonl[.gz], .parquet; epath: gs:// works with gcsfs), "
                        "hf:SAVED_DIR, hf:BUILDER:FILES (json/csv/parquet/text), hf:DIR, tfds:NAME[/CONFIG][:VERSION] "
                        "or tfds:BUILDER_DIR; without it the default corpus (KJV) is prepared")
    parser.add_argument("--format", choices=sources.KINDS, help="kind of every file input (default: by extension)")
    parser.add_argument("--field", help="JSONL key / Parquet or dataset column holding the text (default: text; "
                        "with --chat each whole JSONL record, or name a dataset's messages column)")
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
    parser.add_argument("--chat", action="store_true", help="conversations ({\"messages\": [...]} or {\"prompt\", "
                        "\"completion\"}), rendered with the tokenizer directory's chat template, with loss weights "
                        "on the assistant's tokens (docs/fine-tuning.md)")
    parser.add_argument("--preference", action="store_true", help="preference pairs for DPO ({\"prompt\", "
                        "\"chosen\", \"rejected\"}), as chat data weighted on the responses")
    parser.add_argument("--prompts", action="store_true", help="prompts for RL (train.objective=grpo): JSONL "
                        "records with a \"prompt\" (text, or chat messages rendered with the generation prompt) and "
                        "any fields its rewards read, e.g. \"answer\" (docs/fine-tuning.md)")
    parser.add_argument("--heldout_prompts", type=int, default=0, help="with --prompts: prompts held out for the "
                        "generation evals")
    parser.add_argument("--chat_template", help="with --chat: a Jinja template file instead of the tokenizer's own")
    parser.add_argument("--max_len", type=int, help="with --chat: the most tokens a conversation keeps (train.seq_len); "
                        "with --preference: a pair's two sequences together")
    parser.add_argument("--max_bad_fraction", type=float, default=prepare.MAX_BAD_FRACTION,
                        help="JSONL lines that are not JSON objects are skipped and counted, the first few named on "
                        "stderr; past this fraction of all records prepare exits 2 (0: at the first one)")
    parser.add_argument("--runner", help="build the shards on this Apache Beam runner (DirectRunner, FlinkRunner, "
                        "SparkRunner, ...) instead of --workers processes: the same bytes; the inputs and the work "
                        "dir must be paths every Beam worker sees (pip install 'jaxtrain[beam]')")
    parser.add_argument("--beam_options", default="", help="with --runner: more Beam pipeline options, e.g. "
                        "'--flink_master=host:8081 --parallelism=64'")
    parser.add_argument("--truncate", choices=encode.TRUNCATE, default="left",
                        help="with --chat: a longer conversation loses its oldest tokens (left), or is dropped")
    args = parser.parse_args(argv)
    if args.prompts:
        if not args.input or storage.is_url(args.output):
            parser.error("--prompts needs --input JSONL files and a local --output")
        prompts.prepare_prompts(args.output, args.input, tokenizer=args.tokenizer, chat_template=args.chat_template,
                                max_prompt_tokens=args.max_len, heldout=args.heldout_prompts, seed=args.seed)
        return 0
    chat = args.chat or args.preference
    if not chat and (args.chat_template or args.max_len):
        parser.error("--chat_template and --max_len apply to --chat and --preference data only")
    field = args.field or (sources.RECORD if chat else "text")
    storage.check_url(args.output, "--output")
    output = args.staging or writer.staging_dir(args.output) if storage.is_url(args.output) else args.output
    if args.staging and output == args.output:
        parser.error("--staging applies to a gs:// or s3:// --output only")
    if args.input:
        prepare.prepare_sources(output, args.input, fmt=args.format, field=field,
                                text_split=args.text_split, tokenizer=args.tokenizer, eos_token=args.eos_token,
                                vocab_size=args.vocab_size, heldout_docs=args.heldout_docs, seed=args.seed,
                                num_shards=args.num_shards, workers=args.workers, split=args.split,
                                tfds_data_dir=args.tfds_data_dir, chat=args.chat,
                                chat_template=args.chat_template, max_len=args.max_len, truncate=args.truncate,
                                preference=args.preference, max_bad_fraction=args.max_bad_fraction,
                                runner=args.runner, beam_options=args.beam_options)
    elif chat:
        parser.error("--chat and --preference need --input")
    elif args.runner:
        parser.error("--runner applies to --input data")
    else:
        corpus.prepare_default_corpus(output, args.vocab_size, args.heldout_docs, args.seed)
    if output != args.output:
        writer.publish(output, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    compat.beam.install()  # --runner imports Beam, which warns about Google Cloud clients it will not use
    return common.run(_prepare, argv)
