"""Secrets never appear in errors or logs (shared/redact.py): the services as real processes, a
settings error, a store URL with credentials, and a log line or traceback that would carry one.

Before: a bad BURSTRL_TOKEN stopped a service with pydantic's error, which echoed the settings it
had read: `input_value={'REDIS_URL': 'redis://:h...`, the first character of the Redis password,
and the token itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.redact import MASK, SecretFilter, redact_url, secret_values
from shared.store import StoreError, open_store

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "hunter2-is-the-redis-password"
TOKEN = "short-tok"  # too short: the settings refuse it


@pytest.mark.parametrize("role", ["api", "reward", "ref", "trainer"])
def test_a_refused_setting_never_echoes_the_settings(role, tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("BURSTRL_")},
        "REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:1/0",
        "STORE_URL": f"file://{tmp_path / 'store'}",
        "BURSTRL_TOKEN": TOKEN,
        "BURSTRL_PORT": "0",
        "BURSTRL_REF_MODEL": "m",  # ref's one required setting
    }
    p = subprocess.run(
        [sys.executable, "-m", f"services.{role}"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "BURSTRL_TOKEN must be a real secret" in out, out[-3000:]
    for leak in (PASSWORD, PASSWORD[:8], "redis://:h", TOKEN):
        assert leak not in out, f"{leak!r} in the output:\n{out[-3000:]}"


def test_a_store_url_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(StoreError) as e:
        open_store("s3://AKIAEXAMPLE:wJalrXUtnFEMIK7MDENG@bucket/prefix")
    assert "wJalrXUtnFEMIK7MDENG" not in str(e.value) and "AWS_SECRET_ACCESS_KEY" in str(e.value)
    with pytest.raises(StoreError) as e:
        open_store("ftp://user:wJalrXUtnFEMIK7MDENG@host/x")
    assert "wJalrXUtnFEMIK7MDENG" not in str(e.value)


def test_urls_lose_their_password_and_keep_the_rest():
    assert (
        redact_url(f"rediss://default:{PASSWORD}@redis.example:6380/0")
        == f"rediss://default:{MASK}@redis.example:6380/0"
    )
    assert redact_url("http://10.0.0.5:8000/v1") == "http://10.0.0.5:8000/v1"


def test_log_lines_and_tracebacks_carrying_a_secret_are_masked():
    env = {
        "REDIS_URL": f"redis://:{PASSWORD}@h:6379/0",
        "BURSTRL_TOKEN": "the-api-token-0123456789",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-key-xyz",
        "BURSTRL_ROLLOUT_ENGINE_URL": "http://u:engine-pass@gpu:8000",
        "BURSTRL_ROLLOUT_ENGINE_API_KEY": "engine-api-key",
        "BURSTRL_DEV": "1",
    }
    secrets = secret_values(env)
    assert set(secrets) == {
        PASSWORD,
        env["BURSTRL_TOKEN"],
        env["AWS_SECRET_ACCESS_KEY"],
        "engine-pass",
        "engine-api-key",
    }
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "connect %s failed", (env["REDIS_URL"],), None)
    try:
        raise RuntimeError(f"token {env['BURSTRL_TOKEN']} refused")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    SecretFilter(secrets).filter(record)
    text = logging.Formatter().format(record)
    assert PASSWORD not in text and env["BURSTRL_TOKEN"] not in text and text.count(MASK) == 2, text


def test_a_readiness_reason_never_shows_a_secret(monkeypatch):
    """/readyz needs no token: a check's reason is masked like a log line."""
    from shared import redact
    from shared.service import Health

    monkeypatch.setattr(redact, "_installed", secret_values({"REDIS_URL": f"redis://:{PASSWORD}@h:6379/0"}))
    h = Health()
    h.set("engine", False, f"remote engine http://u:{PASSWORD}@gpu:8000 unreachable")
    assert PASSWORD not in str(h.snapshot()) and MASK in h.snapshot()[1]["engine"]["reason"]
