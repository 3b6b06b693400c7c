"""A loopback TCP proxy that a test or the chaos bench can cut and restore: the store (or any
server) going away mid-run, as a network partition would, without touching the server."""

from __future__ import annotations

import select
import socket
import threading

from services.cli.launch import free_port


class TcpProxy:
    """127.0.0.1:port -> 127.0.0.1:upstream. `up()` listens; `down()` closes the port and cuts
    every open connection; `up()` again restores it on the same port."""

    def __init__(self, upstream: int) -> None:
        self.upstream, self.port = upstream, free_port()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._srv: socket.socket | None = None

    def up(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        self._srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            if self._srv is not None:
                # shutdown first: a bare close() leaves the thread blocked in accept() holding the
                # listening socket, which then takes one more connection through.
                try:
                    self._srv.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._srv.close()
                self._srv = None
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                a, _ = srv.accept()
            except OSError:
                return  # closed by down()
            try:
                b = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                a.close()
                continue
            with self._lock:
                self._conns += [a, b]
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        raise OSError
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass
