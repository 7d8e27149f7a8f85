"""The CPU backend (``backend="gloo"``, named after PyTorch's): ranks joined by TCP sockets, one
per pair of ranks, collectives on NumPy arrays.

The algorithms are the simplest that are correct: reductions and gathers go through rank 0
(every rank sends its array to rank 0, rank 0 combines them in rank order and sends the result
back), broadcast goes from the source straight to every rank. That is O(world size) traffic
through rank 0, fine for tests and small CPU runs; a ring would be the next step if it ever
matters. Combining in rank order on one rank makes every rank's result bit-identical.

Every frame says which collective it belongs to (its sequence number, name, dtype and shape),
so ranks that call different collectives, or pass different shapes, fail with both sides named
instead of exchanging garbage. A rank that fails sends an error frame to every peer; a rank
that sees an error (a peer's, a closed connection, a timeout) passes it on, so one failure
stops every rank with the first rank's message.
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np

from flame.distributed.store import DistributedError, DistributedTimeout, TCPStore, recv_exactly

_FRAME = struct.Struct("!BII")  # kind, meta length, data length
_DATA, _ERROR = 0, 1
_HELLO = struct.Struct("!II")  # rank, world size


class GlooGroup:
    """The sockets of one rank to every other rank, and the collectives over them."""

    def __init__(self, store: TCPStore, rank: int, world_size: int, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.peers: dict[int, socket.socket] = {}
        self.sequence = 0
        self.aborted: str | None = None
        try:
            self._connect_mesh(store)
        except DistributedError as error:
            self.abort(f"rank {rank} failed to join: {error}")
            self.close()
            raise

    # --- rendezvous -------------------------------------------------------------------------
    def _connect_mesh(self, store: TCPStore) -> None:
        """Each rank listens and publishes its address; rank j connects to every rank below it
        and accepts every rank above it (connecting never waits for the accept, so no cycle)."""
        host = store._sock.getsockname()[0]  # the interface that reaches rank 0
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(self.world_size)
            port = listener.getsockname()[1]
            store.set(f"gloo/{self.rank}", f"{host}:{port}:{self.world_size}")
            for peer in range(self.rank):
                self.peers[peer] = self._connect_to(store, peer)
            self._accept_from(listener, range(self.rank + 1, self.world_size))
        finally:
            listener.close()

    def _connect_to(self, store: TCPStore, peer: int) -> socket.socket:
        try:
            published = store.get(f"gloo/{peer}").decode()
        except DistributedTimeout as error:
            raise DistributedTimeout(f"rank {peer} never joined: {error}") from None
        host, port, world_size = published.rsplit(":", 2)
        if int(world_size) != self.world_size:
            raise DistributedError(
                f"rank {peer} has world_size {world_size}, this rank (rank {self.rank}) has "
                f"{self.world_size}: every rank must be given the same WORLD_SIZE"
            )
        sock = socket.create_connection((host, int(port)), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_HELLO.pack(self.rank, self.world_size))
        return sock

    def _accept_from(self, listener: socket.socket, expected: range) -> None:
        deadline = time.monotonic() + self.timeout
        while len(self.peers) < self.world_size - 1:
            missing = [rank for rank in expected if rank not in self.peers]
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock, _ = listener.accept()
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                peer, world_size = _HELLO.unpack(recv_exactly(sock, _HELLO.size))
            except (TimeoutError, ConnectionError):
                raise DistributedTimeout(
                    f"rank {self.rank}: ranks {missing} did not connect within {self.timeout:g}s"
                ) from None
            if peer not in missing:
                sock.close()
                raise DistributedError(f"rank {self.rank}: two processes joined as rank {peer}")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peers[peer] = sock

    # --- frames -----------------------------------------------------------------------------
    def _send(self, peer: int, meta: str, data: bytes) -> None:
        sock = self.peers[peer]
        sock.settimeout(self.timeout)
        try:
            sock.sendall(_FRAME.pack(_DATA, len(meta), len(data)) + meta.encode())
            sock.sendall(data)
        except TimeoutError:
            self._fail(f"{meta}: rank {peer} took no data for {self.timeout:g}s (is it stuck?)")
        except OSError as error:
            self._fail(f"{meta}: lost rank {peer} ({error}; it exited or failed)")

    def _recv(self, peer: int, meta: str) -> bytes:
        sock = self.peers[peer]
        sock.settimeout(self.timeout)
        try:
            kind, meta_length, data_length = _FRAME.unpack(recv_exactly(sock, _FRAME.size))
            their_meta = recv_exactly(sock, meta_length).decode()
            data = recv_exactly(sock, data_length)
        except TimeoutError:
            self._fail(
                f"{meta}: no data from rank {peer} within {self.timeout:g}s (is it stuck, or "
                "did it skip this collective?)"
            )
        except (OSError, ConnectionError):
            self._fail(
                f"{meta}: rank {peer} closed its connection (it exited or failed; its own "
                "error is in its output)"
            )
        if kind == _ERROR:
            self._fail(data.decode(), forwarded=True)
        if their_meta != meta:
            self._fail(f"ranks disagree: rank {peer} is at {their_meta}, this rank at {meta}")
        return data

    def _fail(self, message: str, forwarded: bool = False):
        text = message if forwarded else f"rank {self.rank}: {message}"
        self.abort(text)
        raise DistributedError(text)

    def abort(self, message: str) -> None:
        """Tell every peer this group is dead, with ``message``; best effort, never raises."""
        if self.aborted is not None:
            return
        self.aborted = message
        data = message.encode()
        for sock in self.peers.values():
            try:
                sock.settimeout(1.0)
                sock.sendall(_FRAME.pack(_ERROR, 0, len(data)) + data)
                # end our side cleanly (FIN after the frame): the peer reads the error, not a reset
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers.clear()

    # --- collectives on NumPy arrays --------------------------------------------------------
    def _meta(self, name: str, array: np.ndarray) -> str:
        if self.aborted is not None:
            raise DistributedError(f"the process group was aborted: {self.aborted}")
        self.sequence += 1
        return f"{name} #{self.sequence} {array.dtype}{list(array.shape)}"

    def _gather_to_root(self, meta: str, array: np.ndarray) -> list[np.ndarray] | None:
        """Every rank's array on rank 0 (in rank order), ``None`` elsewhere."""
        if self.rank != 0:
            self._send(0, meta, np.ascontiguousarray(array).tobytes())
            return None
        arrays = [array]
        for peer in range(1, self.world_size):
            data = self._recv(peer, meta)
            arrays.append(np.frombuffer(data, array.dtype).reshape(array.shape))
        return arrays

    def _from_root(self, meta: str, result: np.ndarray | None, like: np.ndarray) -> np.ndarray:
        """Rank 0's ``result`` on every rank."""
        if self.rank != 0:
            data = self._recv(0, meta + " result")
            return np.frombuffer(data, like.dtype).reshape(like.shape).copy()
        payload = np.ascontiguousarray(result).tobytes()
        for peer in range(1, self.world_size):
            self._send(peer, meta + " result", payload)
        return result

    def all_reduce(self, array: np.ndarray, op: str) -> np.ndarray:
        meta = self._meta(f"all_reduce({op})", array)
        arrays = self._gather_to_root(meta, array)
        result = None if arrays is None else reduce_arrays(arrays, op)
        return self._from_root(meta, result, array)

    def broadcast(self, array: np.ndarray, src: int) -> np.ndarray:
        meta = self._meta(f"broadcast(src={src})", array)
        if self.rank == src:
            payload = np.ascontiguousarray(array).tobytes()
            for peer in self.peers:
                self._send(peer, meta, payload)
            return array
        data = self._recv(src, meta)
        return np.frombuffer(data, array.dtype).reshape(array.shape).copy()

    def all_gather(self, array: np.ndarray) -> list[np.ndarray]:
        meta = self._meta("all_gather", array)
        arrays = self._gather_to_root(meta, array)
        stacked = None if arrays is None else np.stack(arrays)
        like = np.empty((self.world_size, *array.shape), array.dtype)
        return list(self._from_root(meta, stacked, like))

    def reduce_scatter(self, arrays: list[np.ndarray], op: str) -> np.ndarray:
        stacked = np.stack(arrays)
        meta = self._meta(f"reduce_scatter({op})", stacked)
        everyone = self._gather_to_root(meta, stacked)
        if everyone is None:
            return np.frombuffer(self._recv(0, meta + " result"), stacked.dtype).reshape(
                stacked.shape[1:]
            )
        reduced = reduce_arrays(everyone, op)
        for peer in range(1, self.world_size):
            self._send(peer, meta + " result", np.ascontiguousarray(reduced[peer]).tobytes())
        return reduced[0]

    def barrier(self) -> None:
        self.all_reduce(np.zeros(1, np.int32), "sum")


def reduce_arrays(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """``arrays`` combined elementwise in list order, in their own dtype (as NCCL does)."""
    combine = {"sum": np.add, "avg": np.add, "product": np.multiply}
    combine.update({"max": np.maximum, "min": np.minimum})
    result = arrays[0].copy()
    for array in arrays[1:]:
        result = combine[op](result, array).astype(result.dtype)
    if op != "avg":
        return result
    count = len(arrays)
    if np.issubdtype(result.dtype, np.integer):
        # integer AVG truncates toward zero, as NCCL's does
        return (np.sign(result) * (np.abs(result) // count)).astype(result.dtype)
    return (result / count).astype(result.dtype)
