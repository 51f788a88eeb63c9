"""The disk tier: one file per block under a directory of its own, within a byte budget.

Writes and reads run on one background thread, in the order they were asked for, so a file is
never read while it is written or deleted. The engine thread never waits on the disk: a write's
bytes stay readable from memory (`writing`) until its file is complete, and a read lands in
`staged`, where the next prefix lookup finds it. Least recently used files are deleted to make
room. The directory (`moe-serve-kv-<pid>-<n>` under the given path) is this engine's alone and is
removed at shutdown: nothing is reused across restarts.

Failures never reach a request: a full disk (ENOSPC) or an I/O error on a write loses that block,
on a read it becomes a miss (the prompt's tokens are recomputed), each kind logged once. `open` is
the one seam a test replaces to make the disk fail; a small budget is enforced for real.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger("moe_serve.kv_offload")
Key = tuple[int, bytes]
_dirs = itertools.count()
# Read blocks kept for the lookup that asked for them: at least this many bytes (else a quarter of
# the tier), so that one prompt's whole prefix can be read before its request resumes.
STAGED_BYTES = 256 << 20


class DiskTier:
    name = "disk"
    open = staticmethod(open)  # the I/O seam (tests inject failures here)

    def __init__(self, root: str, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.dir = os.path.join(root, f"moe-serve-kv-{os.getpid()}-{next(_dirs)}")
        os.makedirs(self.dir)
        weakref.finalize(self, shutil.rmtree, self.dir, True)  # at exit too, if never shut down
        self.lock = threading.Lock()
        self.index: OrderedDict[Key, int] = OrderedDict()  # complete files, least recently used first
        self.used = 0  # bytes of complete files and of writes under way
        self.writing: dict[Key, torch.Tensor] = {}
        self.reads: dict[Key, Future] = {}
        self.staged: OrderedDict[Key, torch.Tensor] = OrderedDict()  # read, not yet taken
        self.staged_bytes = 0
        self.lost: list[Key] = []  # left the tier (evicted, failed): the store reports them
        self.generation = 0  # bumped by clear: work asked for before it is dropped
        self.saved_bytes = self.read_bytes = 0
        self.read_seconds = 0.0
        self.errors: dict[str, int] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")

    def _path(self, key: Key) -> str:
        return os.path.join(self.dir, f"{key[0]}-{key[1].hex()}")

    def __contains__(self, key: Key) -> bool:
        """Whether a file holds key, or will (a read's staged copy is not kept: it does not count)."""
        with self.lock:
            return key in self.index or key in self.writing

    # --- engine thread --------------------------------------------------------------------------
    def put(self, key: Key, data: torch.Tensor) -> None:
        """Write data under key in the background (nothing when it is held already or too large)."""
        with self.lock:
            if key in self.index or key in self.writing or data.numel() > self.capacity:
                if data.numel() > self.capacity:
                    self.lost.append(key)
                return
            self.writing[key] = data
        self._thread.submit(self._write, key, data, self.generation)

    def find(self, key: Key) -> torch.Tensor | bool | None:
        """The bytes when in memory (being written, or read already), None while being read (a read
        is started if none is), False when the tier does not hold key."""
        with self.lock:
            data = self.writing.get(key)
            if data is None:
                data = self.staged.get(key)
            if data is not None:
                return data
            if key in self.reads:
                return None
            if key not in self.index:
                return False
            self.index.move_to_end(key)
            self.reads[key] = self._thread.submit(self._read, key, self.generation)
            return None

    def take_staged(self, key: Key) -> None:
        """The staged copy of key was used: drop it (the file stays)."""
        with self.lock:
            data = self.staged.pop(key, None)
            if data is not None:
                self.staged_bytes -= data.numel()

    def reading(self) -> list[Future]:
        with self.lock:
            return list(self.reads.values())

    def take_lost(self) -> list[Key]:
        with self.lock:
            out, self.lost = self.lost, []
            return out

    def clear(self) -> list[Key]:
        """Forget every block (their files are deleted in the background); returns their keys."""
        with self.lock:
            keys = list(self.index) + list(self.writing) + list(self.staged)
            files = list(self.index)
            self.index.clear()
            self.writing.clear()
            self.staged.clear()
            self.staged_bytes = 0
            self.used = 0
            self.generation += 1
        self._thread.submit(self._delete, files)
        return keys

    def flush(self) -> None:
        """Wait until the writes and reads asked for so far are done (tests; a deterministic point)."""
        self._thread.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- the disk thread ------------------------------------------------------------------------
    def _failed(self, what: str, key: Key, e: OSError) -> None:
        kind = f"{what}:{errno.errorcode.get(e.errno, 'EIO') if e.errno else type(e).__name__}"
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.errors[kind] == 1:  # once per kind: a failing disk would flood the log otherwise
            log.warning("KV disk tier: %s failed (%s); the block is not kept there and a prompt that "
                        "needs it recomputes it (logged once per kind)", what, e)
        self.lost.append(key)

    def _write(self, key: Key, data: torch.Tensor, generation: int) -> None:
        size = data.numel()
        with self.lock:
            if generation != self.generation:
                return
            while self.used + size > self.capacity and self.index:
                old, n = self.index.popitem(last=False)
                self.used -= n
                self.lost.append(old)
                self._remove(old)
            self.used += size
        try:
            with self.open(self._path(key), "wb") as f:
                f.write(memoryview(data.numpy()))
        except OSError as e:
            with self.lock:
                if generation == self.generation:  # (clear has reset the count already)
                    self.used -= size
                self.writing.pop(key, None)
                self._failed("write", key, e)
            self._remove(key)
            return
        with self.lock:
            if generation != self.generation or self.writing.pop(key, None) is None:
                self._remove(key)
                return
            self.index[key] = size
            self.saved_bytes += size

    def _read(self, key: Key, generation: int) -> None:
        t0 = time.perf_counter()
        with self.lock:
            size = self.index.get(key)
        try:
            if size is not None:
                buf = torch.empty(size, dtype=torch.uint8)
                with self.open(self._path(key), "rb") as f:
                    got = f.readinto(memoryview(buf.numpy()))
                if got != size:
                    raise OSError(errno.EIO, f"short read: {got} of {size} bytes")
        except OSError as e:
            with self.lock:
                if self.index.pop(key, None) is not None:
                    self.used -= size
                    self._failed("read", key, e)
                self.reads.pop(key, None)
            self._remove(key)
            return
        with self.lock:
            self.reads.pop(key, None)
            if size is None or generation != self.generation or key not in self.index:
                return  # evicted or cleared meanwhile: a miss
            self.staged[key] = buf
            self.staged_bytes += size
            self.read_bytes += size
            self.read_seconds += time.perf_counter() - t0
            while self.staged_bytes > max(self.capacity // 4, STAGED_BYTES) and len(self.staged) > 1:
                _, old = self.staged.popitem(last=False)  # read for a lookup that never came back
                self.staged_bytes -= old.numel()

    def _remove(self, key: Key) -> None:
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def _delete(self, keys: list[Key]) -> None:
        for key in keys:
            self._remove(key)
