"""Apache Beam's import-time warning about Google Cloud clients a `prepare --runner` job does not use.

`import apache_beam` logs "apitools not found, and bigquery client libraries are not available ..." on the root
logger when the GCP extras are missing, which they are for jaxtrain's runners (DirectRunner, Flink, Spark over a
shared file system). `install()` adds a filter for that one message to the root logger. It can go when Beam
logs it at debug level or only when a GCP transform is used (we know of no upstream issue).
"""

from __future__ import annotations

import logging

MESSAGE = "apitools not found"


class _GcpClientsMissing(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(MESSAGE)


def install() -> None:
    root = logging.getLogger()
    if not any(isinstance(f, _GcpClientsMissing) for f in root.filters):
        root.addFilter(_GcpClientsMissing())
