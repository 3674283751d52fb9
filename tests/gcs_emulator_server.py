"""`python tests/gcs_emulator_server.py PORT BUCKET [DATA_DIR]`: gcp-storage-emulator (in memory without
DATA_DIR), plus the `x-goog-generation` header that real GCS sends with an object's bytes. tensorstore reads
an object's generation from it, and Orbax's OCDBT checkpoints make conditional writes with that generation:
without it, a manifest update fails with "Malformed StorageGeneration". On disk, every file is replaced whole
(as a GCS object is): a stop in the middle of a write, which is how tests make an outage, would otherwise leave
the emulator's own index half-written, and the next start fails on it."""

import os
import sys
import time

from gcp_storage_emulator import storage
from gcp_storage_emulator.handlers import objects

_write_bytes = storage._FileStore.write_bytes


def write_bytes(self, rel, content):
    if self._use_memory:
        return _write_bytes(self, rel, content)
    _write_bytes(self, rel + ".partial", content)
    os.replace(self._disk_path(rel + ".partial"), self._disk_path(rel))


storage._FileStore.write_bytes = write_bytes

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
    except Exception:  # noqa: BLE001 - a missing object: the handler answers 404 itself
        pass
    return _download(request, response, storage, *args, **kwargs)


objects.download = download  # before server.py builds its routes from it

from gcp_storage_emulator.server import create_server  # noqa: E402

if __name__ == "__main__":
    port, bucket, data_dir = int(sys.argv[1]), sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
    create_server("127.0.0.1", port, in_memory=data_dir is None, default_bucket=bucket, data_dir=data_dir).start()
    while True:
        time.sleep(3600)
