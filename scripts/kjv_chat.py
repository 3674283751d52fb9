"""Writes the fine-tuning walkthrough's chat and preference data, made from the KJV (jaxtrain.data.examples).

    python scripts/kjv_chat.py --output data/kjv_chat [--examples 4000]
"""

import argparse

from jaxtrain.data import examples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--examples", type=int, default=4000, help="conversations and pairs, each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = examples.write_kjv_chat(args.output, args.examples, args.seed)
    print(f"{args.examples} conversations, {args.examples} pairs and a chat template -> "
          f"{', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
