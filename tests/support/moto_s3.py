"""An S3-compatible server for tests: moto's, started on loopback, with one bucket made."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def moto_s3(*buckets: str) -> Iterator[dict[str, object]]:
    """Storage options as TOKENMILL_STORAGE_OPTIONS would carry them, for a fresh moto server
    holding the empty buckets (stopped on exit)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options: dict[str, object] = {
            "endpoint_url": f"http://{host}:{port}",
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "skip_instance_cache": True,
        }
        client = boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield options
    finally:
        server.stop()
