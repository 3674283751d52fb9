"""Local object stores for tests: the GCS emulator (gcp-storage-emulator) and S3 (moto's server), each in a
subprocess on a free port, with the environment variables that point every client at it. Nothing leaves the
machine. `stop()` and `start()` make an outage: the GCS emulator keeps its objects on disk across it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, argv_fn, probe: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._argv_fn, self._probe, self._proc = argv_fn, probe, None

    def start(self) -> None:
        self._proc = subprocess.Popen(self._argv_fn(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + self._probe, timeout=2)
                return
            except OSError as e:
                if getattr(e, "code", None):  # an HTTP error: it answers
                    return
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise RuntimeError(f"emulator on {self.url} did not start") from e
                time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None


class GCS(_Server):
    """gs://<bucket> served from `root` (a directory, kept across stop/start), or from memory if root is None."""

    def __init__(self, root=None, bucket: str = "bucket"):
        self.bucket = bucket
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator_server.py")
        super().__init__(lambda port: [sys.executable, script, str(port), bucket, *([str(root)] if root else [])],
                         f"/storage/v1/b/{bucket}")

    def env(self) -> dict:
        return {"STORAGE_EMULATOR_HOST": self.url,  # gcsfs, google-cloud-storage
                "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url,  # ArrayRecord's GCS client
                "TENSORSTORE_GCS_HTTP_URL": self.url,  # Orbax's arrays
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # no gRPC bucket-type probe (the emulator has none)


class S3(_Server):
    """s3://<bucket> served by moto (in memory: a restart loses the objects)."""

    def __init__(self, bucket: str = "bucket"):
        self.bucket = bucket
        super().__init__(lambda port: [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-p", str(port)],
                         "/moto-api/")

    def start(self) -> None:
        super().start()
        import boto3
        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="test",
                     aws_secret_access_key="test").create_bucket(Bucket=self.bucket)

    def env(self) -> dict:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1"}
