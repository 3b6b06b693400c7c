"""moto's S3 server with its objects written through to a folder, in place of MinIO for the container tests.

moto keeps everything in memory, so a restarted container would start with an empty store, unlike
MinIO on its volume: `down` then `up` must find the policy versions and checkpoints again. So every
mutating request (PUT, POST, DELETE) that succeeded is followed, before its response goes out, by a
sync of the changed objects into DATA_DIR (one file per object, written to a temporary name and
renamed), and the folder is loaded back into moto at start. Only the newest version of each object
is kept, which is all burstrl reads. A test stand-in, pinned to moto 5.2.5's backend layout.

    s3_server.py [--host 0.0.0.0] [--port 9000] [--data /data]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
from pathlib import Path
from urllib.parse import quote, unquote

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import FakeDeleteMarker, s3_backends
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple

MUTATING = {"PUT", "POST", "DELETE"}


class Mirror:
    """The on-disk copy: DATA_DIR/<bucket>/<quoted key>, plus what was last written (by etag)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[tuple[str, str], str] = {}
        self.lock = threading.Lock()

    def load(self) -> int:
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        n = 0
        for bdir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            backend.create_bucket(bdir.name, os.environ.get("AWS_REGION", "us-east-1"))
            for f in sorted(bdir.iterdir()):
                if f.name.startswith(".tmp-"):
                    f.unlink()  # a write cut short by a crash: its object was never acknowledged
                    continue
                key = backend.put_object(bdir.name, unquote(f.name), f.read_bytes())
                self.written[(bdir.name, key.name)] = key.etag
                n += 1
        return n

    def sync(self) -> None:
        with self.lock:
            seen: set[tuple[str, str]] = set()
            for regions in s3_backends.values():
                for bucket in regions["aws"].buckets.values():
                    bdir = self.root / bucket.name
                    bdir.mkdir(exist_ok=True)
                    for name in list(bucket.keys.keys()):
                        key = bucket.keys.get(name)
                        # In a versioned bucket a deleted object's newest version is a delete
                        # marker (no etag, no body): the object is gone, so its file goes too.
                        if key is None or isinstance(key, FakeDeleteMarker):
                            continue
                        seen.add((bucket.name, name))
                        if self.written.get((bucket.name, name)) != key.etag:
                            self._write(bdir / quote(name, safe=""), key.value)
                            self.written[(bucket.name, name)] = key.etag
            for bucket_name, name in set(self.written) - seen:
                (self.root / bucket_name / quote(name, safe="")).unlink(missing_ok=True)
                del self.written[(bucket_name, name)]

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        tmp = path.with_name(f".tmp-{hashlib.sha256(path.name.encode()).hexdigest()[:16]}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def write_through(app, mirror: Mirror):  # noqa: ANN001, ANN201 (WSGI)
    """Sync after every successful mutating request, before the client sees the response."""

    def wrapped(environ, start_response):  # noqa: ANN001, ANN202
        status: list[str] = []

        def capture(s, headers, exc_info=None):  # noqa: ANN001, ANN202
            status.append(s)
            return start_response(s, headers, exc_info)

        if environ.get("REQUEST_METHOD") not in MUTATING:
            return app(environ, start_response)
        body = list(app(environ, capture))  # the response is complete: moto has applied the change
        if status and status[0][:1] == "2":
            mirror.sync()
        return body

    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--data", type=Path, default=Path("/data"))
    args = ap.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    mirror = Mirror(args.data)
    print(f"s3: {mirror.load()} objects restored from {args.data}", flush=True)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, write_through(app, mirror), threaded=True)


if __name__ == "__main__":
    main()
