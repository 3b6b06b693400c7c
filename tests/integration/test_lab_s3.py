"""The lab's S3 stand-in (tests/support/lab/s3.py) against moto's real server: a benchmark starts it
with nothing set in its environment, and leaves the environment as it found it."""

from __future__ import annotations

import os

from shared.store import open_store
from tests.support.lab.s3 import moto_s3, s3_env

AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "STORE_ENDPOINT_URL")


def test_moto_s3_makes_its_buckets_and_the_store_reaches_them_from_a_bare_environment(monkeypatch):
    for k in AWS:  # a benchmark's process: no AWS settings of its own (the s3_endpoint fixture sets them)
        monkeypatch.delenv(k, raising=False)
    with moto_s3("lab", "other") as endpoint:
        assert not any(k in os.environ for k in AWS)  # making the buckets left nothing behind
        with s3_env(endpoint):
            assert os.environ["STORE_ENDPOINT_URL"] == endpoint
            store = open_store("s3://lab/run")
            store.put("a/b", b"bytes")
            assert store.get("a/b") == b"bytes"
            open_store("s3://other/x").put("c", b"")  # every bucket asked for exists
        assert not any(k in os.environ for k in AWS)


def test_s3_env_restores_the_settings_it_replaced(monkeypatch):
    monkeypatch.setenv("STORE_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.delenv("AWS_REGION", raising=False)
    with s3_env("http://127.0.0.1:2"):
        assert os.environ["STORE_ENDPOINT_URL"] == "http://127.0.0.1:2"
        assert os.environ["AWS_REGION"] == "us-east-1"
    assert os.environ["STORE_ENDPOINT_URL"] == "http://127.0.0.1:1"
    assert "AWS_REGION" not in os.environ
