#!/usr/bin/env python3
"""Container healthcheck: GET a burstrl service's /readyz; exit 0 only on HTTP 200.

Usage: burstrl-healthcheck [URL]. Without a URL it builds http://127.0.0.1:<port>/readyz from
BURSTRL_PORT, else the role's default port (BURSTRL_ROLE names the role; the image sets it).
/readyz, not /healthz: a service that is alive but cannot reach Redis or has not loaded its
model must not count as healthy, so `depends_on: condition: service_healthy` waits for it.
Standard library only, so it costs nothing in the slim images.
"""

import os
import sys
import urllib.error
import urllib.request

# Mirrors shared.settings.DEFAULT_PORTS (tests/unit/test_deploy_docker.py checks they agree).
DEFAULT_PORTS = {"api": 8700, "rollout": 8701, "reward": 8702, "ref": 8703, "trainer": 8704}


def main() -> int:
    if len(sys.argv) > 1:
        url = sys.argv[1]
    else:
        port = os.environ.get("BURSTRL_PORT") or str(DEFAULT_PORTS[os.environ.get("BURSTRL_ROLE", "api")])
        url = f"http://127.0.0.1:{port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback, fixed scheme)
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:  # 503 (not ready) arrives as HTTPError
        print(f"{url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
