"""A service refuses, with the fix in its log, what waiting for Redis cannot mend.

Waiting is right while Redis restarts; a wrong password or a certificate nobody trusts would
leave the service not-ready forever (a rented trainer burning its hours), so it exits 2 instead.
Real redis-server with TLS and a password, certificates from deploy/burst/make-certs.sh.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """redis-server on a loopback TLS port with a password; (port, dir with ca/ and other-ca/)."""
    tmp = tmp_path_factory.mktemp("tls-redis")
    for name in ("ca", "other-ca"):  # two private CAs: the server's, and one that did not sign it
        subprocess.run(
            ["bash", str(ROOT / "deploy" / "burst" / "make-certs.sh"), "localhost", str(tmp / name)],
            check=True,
            capture_output=True,
        )
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", "0", "--bind", "127.0.0.1", "--tls-port", str(port)]
        + ["--tls-cert-file", str(tmp / "ca" / "server.crt"), "--tls-key-file", str(tmp / "ca" / "server.key")]
        + ["--tls-ca-cert-file", str(tmp / "ca" / "ca.crt"), "--tls-auth-clients", "optional"]
        + ["--requirepass", "right-password", "--save", "", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield port, tmp
    finally:
        proc.kill()
        proc.wait()


def _start_reward(redis_url: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url, "BURSTRL_DEV": "1", "BURSTRL_PORT": "0"}
    env["STORE_URL"] = f"file://{tmp / 'store'}"
    return subprocess.run(
        [sys.executable, "-m", "services.reward"], env=env, capture_output=True, text=True, timeout=90, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("password", "ca", "says"),
    [
        ("wrong-password", "ca", "refused the credentials in REDIS_URL"),
        ("", "ca", "refused the credentials in REDIS_URL"),  # no password for a server that wants one
        ("right-password", "other-ca", "certificate is not trusted"),
    ],
)
def test_wrong_password_or_untrusted_certificate_is_refused_not_waited_out(tls_redis, password, ca, says):
    port, tmp = tls_redis
    auth = f":{password}@" if password else ""
    url = f"rediss://{auth}localhost:{port}/0?ssl_ca_certs={tmp / ca / 'ca.crt'}"
    p = _start_reward(url, tmp)
    assert p.returncode == 2, p.stderr[-2000:]
    assert says in p.stderr, p.stderr[-2000:]
    assert not password or password not in p.stdout + p.stderr  # the refusal never echoes the credential


def test_the_right_password_and_ca_connect(tls_redis):
    """The same server and CA with the right password: the check is not refusing everything."""
    from shared.redis_conn import connect

    port, tmp = tls_redis
    r = connect(f"rediss://:right-password@localhost:{port}/0?ssl_ca_certs={tmp / 'ca' / 'ca.crt'}")
    assert r.ping()
    r.close()
