"""tensorboardX without torch: it imports torch when torch is installed, only to accept torch tensors.

That import slows every run's startup (docs/performance.md, "Compile time and startup"), and jaxtrain logs
floats only. `install()` imports tensorboardX once with torch hidden (unless torch is already
imported), so that later imports find it ready without torch. `tensorboardX/writer.py` tries `import torch` at
module level (we know of no upstream issue); this can go if it ever imports it lazily.
"""

from __future__ import annotations

import sys


def install() -> None:
    """Imports tensorboardX now, with `import torch` failing for the duration if torch is not imported yet."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:  # nothing to gain
        return
    sys.modules["torch"] = None  # `import torch` raises ImportError; tensorboardX then goes without it
    try:
        import tensorboardX  # noqa: F401, PLC0415  # pyflakes: ignore
    except ImportError:  # not installed: the writer says so when it is used
        pass
    finally:
        del sys.modules["torch"]
