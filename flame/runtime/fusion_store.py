"""The fusion pass's groupings on disk (flame/ir/passes/reuse.py), beside the plans.

A process whose first step loads its plan from the plan store (flame/runtime/plan_store.py)
never runs the fusion pass, so it has no grouping to reuse when the step is then called at
a new image size: without this store that graph is fused in full (~1-1.5 s of the UNet's
new-resolution step on the H100 host). Each grouping of a big graph is written here when it
is made, as plain JSON (node positions, kinds, reasons, the shape signatures), under the
sha256 of the structure key's digest, FLAME's sources (``plan_store.source_digest``: any
change to the passes makes old entries unreachable) and the format. Reading one back never
trusts it: ``reuse`` applies it under the same checks as a grouping made in this process,
and anything unreadable is a miss. Off with the plan store (``FLAME_PLAN_CACHE=0``).
"""

from __future__ import annotations

import hashlib
import json

from flame.runtime import plan_store
from flame.runtime.cache import DiskCache

FORMAT = 1


class FusionStore:
    """``Decisions.store`` over the files of ``disk`` (a ``DiskCache``)."""

    def __init__(self, disk: DiskCache, source_digest: str | None = None):
        self.disk = DiskCache(disk.root)  # the same files, counters of its own
        self.source_digest = source_digest
        self.min_nodes = plan_store.MIN_NODES

    def _name(self, key: bytes) -> str:
        digest = hashlib.sha256(b"flame-fusion\0")
        digest.update(f"{FORMAT}\0{self.source_digest or plan_store.source_digest()}\0".encode())
        digest.update(key)
        return digest.hexdigest()

    def get(self, key: bytes) -> list | None:
        if not plan_store.enabled():
            return None
        data = self.disk.get(self._name(key))
        if data is None:
            return None
        try:
            return json.loads(data.decode())
        except (UnicodeDecodeError, ValueError):
            return None

    def put(self, key: bytes, entries: list) -> None:
        if plan_store.enabled():
            self.disk.put(self._name(key), json.dumps(entries, separators=(",", ":")).encode())
