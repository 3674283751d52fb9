"""tokamax reads its options from absl flags, and parses sys.argv itself if no one has parsed the flags.

In a notebook, under pytest or inside another program, those arguments are not absl's, and the first kernel call
fails on them as unknown flags. `install()` marks the flags parsed (with their defaults, which are what jaxtrain
wants) where tokamax is installed and nothing has parsed them yet; jaxtrain's commands parse them with absl as
they start. It can go when tokamax takes its options without absl's global flags (we know of no upstream issue).
"""

from __future__ import annotations

import importlib.util


def install() -> None:
    if importlib.util.find_spec("tokamax") is None:
        return
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
