"""Orbax checkpoints in s3:// buckets.

Orbax 0.12 builds tensorstore specs for local paths and gs:// only (google/orbax#359; the PR that adds S3 is not
merged: this module can go when it is). Tensorstore has its own s3 driver, and etils.epath reaches s3:// through
s3fs for the small files, so the only gap is that spec: `install()` wraps Orbax's three spec helpers so an s3://
path gets the s3 driver and every other path what Orbax gives it. Every process writes its own shards straight
to the bucket, as on gs://.
The endpoint and region come from the variables boto3 reads (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION
or AWS_DEFAULT_REGION); credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY when set, else tensorstore's
AWS chain (profile, instance metadata). S3 has no atomic rename, so a step commits by writing Orbax's
commit_success.txt last (checkpoint.py sets CommitFileTemporaryPath), as on GCS. Either scheme's array writes
and reads retry for about JAXTRAIN_STORAGE_RETRY_SECONDS (`storage.tensorstore_retries`), not tensorstore's
default of about 15 minutes, so a save into a bucket whose endpoint is down fails as a checkpoint error.
`problem()` says why the helpers cannot be wrapped, should a later Orbax rename them; `install()` records it in
`jaxtrain.checkpoint.s3_problem`, which refuses s3:// checkpoint dirs naming the field.
"""

from __future__ import annotations

import os
import threading
from urllib import parse

from jaxtrain import storage

PREFIX = "s3://"
_lock = threading.Lock()
_installed = False


def _modules():
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils
    return gcs_utils, tensorstore_utils


def _names():
    gcs_utils, ts_utils = _modules()
    return [(gcs_utils, "get_kvstore_for_gcs"), (ts_utils, "_use_gcs_driver"), (ts_utils, "_normalize_path")]


def problem() -> str | None:
    """Why s3:// checkpoints cannot work with the installed Orbax, or None."""
    try:
        missing = [f"{m.__name__}.{name}" for m, name in _names() if not callable(getattr(m, name, None))]
    except ImportError as e:
        missing = [str(e)]
    if missing:
        return f"this orbax-checkpoint lacks {', '.join(missing)}, which s3:// checkpoints build on"
    return None


def kvstore_spec(url: str) -> dict:
    """Tensorstore's s3 kvstore spec for `url` (s3://bucket/key/prefix)."""
    parts = parse.urlparse(url)
    spec = {"driver": "s3", "bucket": parts.netloc, "path": parts.path.lstrip("/")}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        spec["endpoint"] = endpoint
        region = region or "us-east-1"  # S3-compatible stores take it; tensorstore cannot look it up from them
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # the default chain would also try (and log about) ~/.aws files
        spec["aws_credentials"] = {"type": "environment"}
    spec["s3_request_retries"] = storage.tensorstore_retries()
    return spec


def _gcs_spec(spec):
    """Orbax's gs:// kvstore spec with the retry budget (a spec of another form passes unchanged)."""
    if isinstance(spec, dict) and spec.get("driver") == "gcs":
        return {**spec, "gcs_request_retries": storage.tensorstore_retries()}
    return spec


def install() -> None:
    """Makes Orbax write and read s3:// paths through tensorstore's s3 driver (idempotent). Where the installed
    Orbax lacks the helpers, changes nothing and leaves the reason in `jaxtrain.checkpoint.s3_problem`."""
    global _installed
    from jaxtrain import checkpoint  # noqa: PLC0415 - where s3:// dirs are checked

    with _lock:
        if _installed:
            return
        checkpoint.s3_problem = problem()
        if checkpoint.s3_problem is not None:
            return
        gcs_utils, ts_utils = _modules()
        kvstore, use_driver, normalize = (gcs_utils.get_kvstore_for_gcs, ts_utils._use_gcs_driver,
                                          ts_utils._normalize_path)
        # normpath turns s3://b into s3:/b; Orbax restores the slash for gs:// only.
        ts_utils._normalize_path = lambda p: (PREFIX + normalize(p[len(PREFIX):]).lstrip("/")
                                              if str(p).startswith(PREFIX) else normalize(p))
        ts_utils._use_gcs_driver = lambda d: str(d).startswith(PREFIX) or use_driver(d)
        gcs_utils.get_kvstore_for_gcs = lambda p: (kvstore_spec(str(p)) if str(p).startswith(PREFIX)
                                                   else _gcs_spec(kvstore(p)))
        _installed = True
