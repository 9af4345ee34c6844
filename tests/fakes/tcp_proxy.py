"""A TCP forwarder between gpuctl and the test sshd that reports each step of an SSH session.

A fake cloud's instance answers SSH through it (its port instead of the sshd's), so a test can
act at a given point of the conversation: ``on_chunk(conn, direction, data)`` runs in the
forwarding thread before each chunk is passed on -- ``conn`` counts connections from 1,
``direction`` is "down" (server to client) or "up" -- and may signal gpuctl (a Ctrl-C at that
SSH step) or block (a stalled network). ``chunks`` logs (conn, direction, size) of every chunk
forwarded or held. ``stop()`` closes the listener and every connection.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class TcpProxy:
    def __init__(self, target: tuple[str, int], on_chunk: Callable[[int, str, bytes], None] | None = None):
        self.target = target
        self.on_chunk = on_chunk
        self.chunks: list[tuple[int, str, int]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._connections = 0

    def __enter__(self) -> TcpProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._connections += 1
                conn = self._connections
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(conn, "up", client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(conn, "down", server, client), daemon=True).start()

    def _pump(self, conn: int, direction: str, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.chunks.append((conn, direction, len(data)))
                if self.on_chunk is not None:
                    self.on_chunk(conn, direction, data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
