"""A loopback TCP relay that can go silent the way a vanished host does (a killed container,
a lost node): its connections stay open, no reset or FIN comes, nothing more arrives."""
from __future__ import annotations

import selectors
import socket
import threading

from tests.processes import free_port


class SilentRelay:
    """A loopback TCP relay to ``upstream`` that ``silence()`` turns into a vanished host: every
    connection, open or new, stays open and swallows what either side sends (no reset, no FIN,
    nothing forwarded)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", free_port()))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self.silent = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def silence(self) -> None:
        self.silent = True

    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select(timeout=0.2):
                sock = key.fileobj
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    self._sockets.append(client)
                    if self.silent:  # a new connection reaches nothing
                        self._sel.register(client, selectors.EVENT_READ, None)
                        continue
                    upstream = socket.create_connection(self._upstream)
                    self._sockets.append(upstream)
                    self._sel.register(client, selectors.EVENT_READ, upstream)
                    self._sel.register(upstream, selectors.EVENT_READ, client)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:  # a side closed: close it and its peer (a vanished host never closes its side)
                    self._drop(sock)
                    if key.data is not None and not self.silent:
                        self._drop(key.data)
                    continue
                if key.data is not None and not self.silent:
                    try:
                        key.data.sendall(data)
                    except OSError:
                        pass

    def _drop(self, sock: socket.socket) -> None:
        """Stop watching ``sock`` and close it: a closed socket left registered would clash with
        a new connection given the same file descriptor."""
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        for s in self._sockets:
            s.close()
