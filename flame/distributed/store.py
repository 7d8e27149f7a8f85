"""A small TCP key-value store for rendezvous: rank 0 serves it at ``MASTER_ADDR:MASTER_PORT``,
every rank (rank 0 included) talks to it as a client.

Values are bytes. ``get`` waits (on the server) until the key is set or the timeout passes, so
no client polls. Every wait has a timeout, and every error names the key and the address.

Wire format, both ways: ``!BII`` (command or status, key length, value length), key, value.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

_HEADER = struct.Struct("!BII")
_SET, _GET, _ADD = 1, 2, 3
_OK, _TIMEOUT = 0, 1
_CONNECT_RETRY_S = 0.05
# the client gives the server this long past a get's own timeout before calling it silent
_ANSWER_GRACE_S = 2.0


class DistributedError(RuntimeError):
    """A collective or the rendezvous failed: a peer failed, left, or sent something unexpected."""


class DistributedTimeout(DistributedError):
    """A wait on the store or on a peer ran past its timeout."""


def recv_exactly(sock: socket.socket, count: int) -> bytes:
    """``count`` bytes from ``sock``; ``ConnectionError`` where the peer closes first."""
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(min(count - len(chunks), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        chunks += chunk
    return bytes(chunks)


def _send_frame(sock: socket.socket, code: int, key: bytes, value: bytes) -> None:
    sock.sendall(_HEADER.pack(code, len(key), len(value)) + key + value)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes, bytes]:
    code, key_length, value_length = _HEADER.unpack(recv_exactly(sock, _HEADER.size))
    return code, recv_exactly(sock, key_length), recv_exactly(sock, value_length)


class StoreServer:
    """The store itself: a listening socket and one thread per client, all daemons."""

    def __init__(self, host: str, port: int):
        self.address = f"{host}:{port}"
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as error:
            self._listener.close()
            raise DistributedError(
                f"rank 0 cannot serve the store at {self.address}: {error} (is the port in use? "
                "choose another MASTER_PORT)"
            ) from None
        self._listener.listen(128)
        self._clients: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, name="flame-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed by close()
                return
            self._clients.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            while True:
                code, key, value = _recv_frame(client)
                status, answer = self._answer(code, key, value)
                _send_frame(client, status, b"", answer)
        except (OSError, ConnectionError):
            client.close()

    def _answer(self, code: int, key: bytes, value: bytes) -> tuple[int, bytes]:
        with self._changed:
            if code == _SET:
                self._data[key] = value
                self._changed.notify_all()
                return _OK, b""
            if code == _ADD:
                total = int(self._data.get(key, b"0")) + int(value)
                self._data[key] = str(total).encode()
                self._changed.notify_all()
                return _OK, self._data[key]
            timeout = float(value)
            if not self._changed.wait_for(lambda: key in self._data, timeout=timeout):
                return _TIMEOUT, b""
            return _OK, self._data[key]

    def close(self) -> None:
        self._listener.close()
        for client in self._clients:
            client.close()


class TCPStore:
    """A client of the store at ``host:port``; rank 0 (``is_master``) also serves it."""

    def __init__(self, host: str, port: int, *, is_master: bool, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.address = f"{host}:{port}"
        self.server = StoreServer(host, port) if is_master else None
        self._sock = self._connect(timeout)
        self._lock = threading.Lock()

    def _connect(self, timeout: float) -> socket.socket:
        # rank 0 may start after the others: retry a refused connection until the timeout
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(left, 0.01))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as error:
                if time.monotonic() + _CONNECT_RETRY_S >= deadline:
                    raise DistributedTimeout(
                        f"could not reach the store at {self.address} within {timeout:g}s "
                        f"({error}); is rank 0 running, and are MASTER_ADDR and MASTER_PORT "
                        "the same on every rank?"
                    ) from None
                time.sleep(_CONNECT_RETRY_S)

    def _request(self, code: int, key: str, value: bytes, wait: float) -> bytes:
        what = {_SET: "set", _GET: "get", _ADD: "add"}[code]
        with self._lock:
            self._sock.settimeout(wait + _ANSWER_GRACE_S)
            try:
                _send_frame(self._sock, code, key.encode(), value)
                status, _, answer = _recv_frame(self._sock)
            except TimeoutError:
                raise DistributedTimeout(
                    f"the store at {self.address} did not answer {what}({key!r}) within "
                    f"{wait + _ANSWER_GRACE_S:g}s"
                ) from None
            except (OSError, ConnectionError) as error:
                raise DistributedError(
                    f"lost the store at {self.address} during {what}({key!r}): {error} "
                    "(did rank 0 exit?)"
                ) from None
        if status == _TIMEOUT:
            raise DistributedTimeout(
                f"store at {self.address}: key {key!r} was not set within {wait:g}s"
            )
        return answer

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._request(_SET, key, data, wait=self.timeout)

    def add(self, key: str, amount: int) -> int:
        return int(self._request(_ADD, key, str(amount).encode(), wait=self.timeout))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` (default: the store's) for it."""
        wait = self.timeout if timeout is None else timeout
        return self._request(_GET, key, repr(float(wait)).encode(), wait=wait)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for key in keys:
            self.get(key, timeout=max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        self._sock.close()
        if self.server is not None:
            self.server.close()
