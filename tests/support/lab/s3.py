"""The S3 stand-in for the lab: moto's server as tests/support/servers.py starts it (one place),
with buckets made, and the settings the store's S3 client reads pointed at it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.servers import make_bucket, start_s3, stop


@contextmanager
def moto_s3(*buckets: str) -> Iterator[str]:
    """moto's S3 server on a free loopback port with these buckets: its endpoint; stopped by pid on exit."""
    proc, endpoint = start_s3()
    try:
        with s3_env(endpoint):  # the client that makes them reads its credentials there too
            for name in buckets:
                make_bucket(endpoint, name)
        yield endpoint
    finally:
        stop(proc)


@contextmanager
def s3_env(endpoint: str) -> Iterator[None]:
    """The store's S3 settings (moto's test credentials, `endpoint`) in os.environ, which every
    service this process starts inherits; restored on exit (a pytest process shares os.environ
    with other tests' S3 servers)."""
    aws = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "STORE_ENDPOINT_URL": endpoint,
    }
    saved = {k: os.environ.get(k) for k in aws}
    os.environ.update(aws)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
