"""The disk tier of the KV cache (``--kv-offloading-path DIR``): blocks the host tier drops
(engine/kv_offload.py) spill to files, and a prefix lookup that misses the device and the
host reads them back into the host tier, from where they load like a host hit.

Ownership: ``DiskKVTier`` alone reads, writes and removes files under ``DIR`` and keeps the
in-memory view of what is there (``_index``: the block hashes of this layout's files). The
host tier calls it with two things: ``spill(hash, host block)`` (copy the block to a staging
buffer now, write it later on the writer thread) and ``read_async([(hash, host block), ...],
done)`` (read and verify those files, in order, into host blocks the host tier reserved for
them, on the reader thread; ``done(hash, ok)`` for each, from that thread). ``read`` is one
such read on the caller's thread.

Files (format version 1), one per KV block::

    DIR/<layout id>/<block hash, 16 hex digits>.kv

    offset  size  field
    0       8     magic b"PDKVBLK\\0"
    8       2     format version (1), little-endian like every field
    10      2     flags (0)
    12      4     record length R
    16      8     block hash (must equal the name's)
    24      8     payload length P (must equal this layout's block bytes)
    32      4     CRC-32 of record + payload
    36      R     layout record: canonical JSON (sorted keys, no spaces), see ``layout_record``
    36+R    P     payload: the block, ``[slots, 2, block_size, kv_heads, head_dim]`` in the KV
                  dtype, C order (the host tier's block as it is)

The block hash is the prefix cache's chained hash (engine/block_hash.py; an adapter's blocks
chain from its own root, its name and contents): equal prefixes give equal names on every
server. The layout id is the first 16 hex digits of the record's SHA-256, so servers of
different models or layouts sharing ``DIR`` never write over each other's names; the record
in each file is compared whole all the same. A file is loaded only if every check passes:
magic, version, record, name, length, checksum. Anything else (a torn or truncated write, a
flipped bit, a file of another layout) is refused, counted by cause, logged once per cause,
removed, and its block recomputed. The checksum is for integrity, not authenticity: whoever
can write ``DIR`` can make this server load the KV they like.

Writes are atomic: a temporary file (``.tmp-*``) in the same directory, then ``os.replace``.
There is no fsync: a file torn by a crash fails its checksum and is refused.

The bound (``--kv-offloading-disk-size`` GiB) is on the whole of ``DIR``, every layout and
server's files, temporary ones included. The writer keeps it: before a write that would pass
it, it rescans ``DIR`` and removes the least recently used files (oldest modification time;
a disk hit touches its file) until the directory is at 90% of the bound. Removing is safe
while other servers share ``DIR``: a file removed under a reader is a miss there (an open
file stays readable), and a file two servers remove at once is gone once. Between rescans a
server sees only its own writes, so with several servers the directory may pass its bound by
what the others wrote since this one's last rescan (every ``rescan_s``, 2 s by default).
Give every server sharing ``DIR`` the same bound. Temporary files older than 10 minutes (a
writer killed mid-write) are removed by the rescans.

Off the step's critical path: the writer thread checksums, writes and cleans up; the step
only copies a dropped host block into a staging buffer (one block's memcpy). The staging
buffers bound the queue: a spill that finds none free is dropped and counted. Reads are on
the reader thread (a file per block: one open, two reads and a CRC), in the order they were
asked for; a run of blocks stops at its first block that does not load (the rest of that
run is reported not loaded, unread: the prefix is recomputed from there). The host tier
bounds the reads outstanding (engine/kv_offload.py) and the request whose prefix they are
waits in the scheduler's waiting queue meanwhile. A reader thread that dies (``reader_alive``
False) ends no read it was given: the host tier then frees their blocks and reads no more.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from engine.block_hash import leading_run
from engine.cpu_threads import serial_thread

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"PDKVBLK\0"
_HEADER = struct.Struct("<8sHHIQQI")  # magic, version, flags, record length, hash, payload length, crc
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # a temporary file this old is a dead writer's
LOW_WATER = 0.9  # a clean-up brings the directory down to this fraction of its bound

# Why a block was not loaded from or written to disk (``errors`` keys, a metric's label).
CAUSES = ("truncated", "corrupt", "version", "layout", "read", "no_space", "write", "directory")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_identity(path: Path, load_format: str, seed: int) -> str:
    """What tells two checkpoints of one name and shape apart, cheaply: the SHA-256 of
    config.json and of each weight file's name, size and three 64 KiB samples (start, middle,
    end: any fine-tune or random init differs there); random weights (``--load-format
    dummy``) by their seed. Copies of one checkpoint on two servers give the same value."""
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    if load_format == "dummy":
        digest.update(f"dummy:{seed}".encode())
        return digest.hexdigest()[:32]
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    for p in weights:
        size = p.stat().st_size
        digest.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            for at in (0, max(0, size // 2 - 32768), max(0, size - 65536)):
                f.seek(at)
                digest.update(f.read(65536))
    return digest.hexdigest()[:32]


def layout_record(kv_cache: torch.Tensor, model: str, model_dtype: str,
                  kv_scales: tuple[Sequence[float], Sequence[float]], weights: str, checkpoint: str,
                  tensor_parallel_size: int) -> dict[str, Any]:
    """What a server must share with the one that wrote a file to load it: the P/D handshake's
    layout record (kv_transfer/protocol.py ``KVLayout``, the same fields and values, for the
    one-group caches without a draft or linear state that the host tier serves), plus the
    checkpoint's identity (a served name alone does not tell two checkpoints apart, nor one
    checkpoint before and after an update) and the tensor-parallel layout.
    ``kv_cache``: [layers, blocks, 2, block_size, kv_heads, head_dim]."""
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return dict(model=model, dtype=_dtype_name(kv_cache.dtype), block_size=block_size, num_layers=num_layers,
                num_kv_heads=num_kv_heads * tensor_parallel_size, head_dim=head_dim,
                k_scales=[float(x) for x in kv_scales[0]], v_scales=[float(x) for x in kv_scales[1]],
                model_dtype=model_dtype, weights=weights, draft=None, groups="", linear_state="",
                checkpoint=checkpoint, tensor_parallel_size=tensor_parallel_size)


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class DiskTierStats:
    """The disk tier's counters (a snapshot; ``errors``: by cause, see ``CAUSES``)."""

    size_bytes: int  # the bound on DIR
    used_bytes: int  # DIR's bytes as this server last knew them
    num_files: int  # this layout's files this server knows of
    stored_blocks_total: int  # files written
    loaded_blocks_total: int  # files read into the host tier (prefix hits there)
    read_bytes_total: int
    written_bytes_total: int
    dropped_spills_total: int  # spills dropped: no staging buffer free (the writer's queue full)
    removed_files_total: int  # removed by the clean-up (least recently used)
    errors: dict[str, int]


class DiskKVTier:
    def __init__(self, path: str | os.PathLike, size_bytes: int, record: dict[str, Any],
                 block_shape: Sequence[int], dtype: torch.dtype, *, num_staging: int | None = None,
                 rescan_s: float = 2.0) -> None:
        """``block_shape``/``dtype``: one host block; ``num_staging``: staging buffers (the bound
        on spills queued; default: 256 MiB worth, 4 to 64)."""
        if size_bytes <= 0:
            raise ValueError(f"--kv-offloading-disk-size must be positive, got {size_bytes} bytes")
        self.root = Path(path)
        self.size_bytes = size_bytes
        self.record = encode_record(record)
        self.layout_id = hashlib.sha256(self.record).hexdigest()[:16]
        self.dir = self.root / self.layout_id
        self.payload_bytes = int(torch.Size(block_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self.file_bytes = _HEADER.size + len(self.record) + self.payload_bytes
        if self.file_bytes > size_bytes:
            raise ValueError(f"--kv-offloading-disk-size {size_bytes / 2**30:g} GiB holds no KV block (a file "
                             f"is {self.file_bytes / 2**20:.2f} MiB)")
        self.rescan_s = rescan_s
        if num_staging is None:
            num_staging = max(4, min(64, (256 << 20) // self.payload_bytes))
        self._staging = torch.empty((num_staging, *block_shape), dtype=dtype)
        self._lock = threading.Lock()  # guards what both threads change: the index, files, free staging
        self._free_staging = list(range(num_staging))
        self._index: set[int] = set()  # hashes of this layout's files (as last seen, plus own writes)
        # Every file under DIR (path -> bytes), least recently used (oldest mtime) first: the writer's.
        self._files: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        self._queue: queue.Queue = queue.Queue(maxsize=4 * num_staging)
        self.stored_blocks_total = self.loaded_blocks_total = 0
        self.read_bytes_total = self.written_bytes_total = 0
        self.dropped_spills_total = self.removed_files_total = 0
        self.errors = {c: 0 for c in CAUSES}
        self._logged: set[str] = set()
        self._rescan()  # what a restarted server finds: loaded only once verified, block by block
        self._next_scan = time.monotonic() + rescan_s
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._closed = False
        self._thread.start()
        # The reader: runs of blocks to read, in order (``read_async``); None stops it.
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._reader.start()

    @classmethod
    def for_engine(cls, config: EngineConfig, kv_cache: torch.Tensor,
                   kv_scales: tuple[Sequence[float], Sequence[float]]) -> DiskKVTier:
        """The tier ``--kv-offloading-path`` and ``--kv-offloading-disk-size`` ask for, for the
        blocks of ``kv_cache`` ([layers, blocks, 2, block_size, kv_heads, head_dim])."""
        mc, cc = config.model, config.cache
        assert cc.kv_offloading_path is not None
        weights = mc.quantization.describe() if mc.quantization is not None else ""
        record = layout_record(kv_cache, mc.served_model_name, mc.dtype, kv_scales, weights,
                               checkpoint_identity(mc.path, mc.load_format, mc.seed), config.tensor_parallel_size)
        tier = cls(cc.kv_offloading_path, int(cc.kv_offloading_disk_size * 2**30), record,
                   tuple(kv_cache[:, 0].shape), kv_cache.dtype)
        logger.info("disk KV tier: %s (layout %s, at most %.1f GiB, %.2f MiB a block; %d files of this layout "
                    "there, %.1f MiB in all)", tier.dir, tier.layout_id, cc.kv_offloading_disk_size,
                    tier.file_bytes / 2**20, len(tier._index), tier.used_bytes / 2**20)
        return tier

    # ---- what is here (the scheduler's thread) -------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` have a file here (as this server last saw ``DIR``)."""
        return leading_run(hashes, self._index)

    def file_of(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def read(self, block_hash: int, out: torch.Tensor) -> bool:
        """Read the block's file into ``out`` (a contiguous host block) and verify it. False
        when it is gone (a miss) or refused (counted; the file is removed): then ``out`` holds
        garbage and the block is to be recomputed."""
        path = self.file_of(block_hash)
        payload = out.view(-1).view(torch.uint8).numpy()  # (fp8 too: bytes are bytes)
        header = bytearray(_HEADER.size + len(self.record))
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(header)
                if got < _HEADER.size:
                    return self._refuse(path, block_hash, "truncated", f"{got} bytes")
                magic, version, _, record_len, name_hash, payload_len, crc = _HEADER.unpack_from(header)
                if magic != MAGIC:
                    return self._refuse(path, block_hash, "corrupt", "not a KV block file")
                if version != FORMAT_VERSION:
                    return self._refuse(path, block_hash, "version", f"format version {version}, this server "
                                                                     f"reads {FORMAT_VERSION}")
                record = bytes(header[_HEADER.size:got])
                if record_len != len(self.record) or record != self.record:
                    if record_len == len(self.record) and got < len(header):
                        return self._refuse(path, block_hash, "truncated", f"{got} bytes")
                    return self._refuse(path, block_hash, "layout", _record_diff(record, self.record, f, record_len))
                if name_hash != block_hash:
                    return self._refuse(path, block_hash, "corrupt", f"holds block {name_hash:016x}")
                if payload_len != self.payload_bytes:
                    return self._refuse(path, block_hash, "corrupt", f"payload of {payload_len} bytes, a block "
                                                                     f"is {self.payload_bytes}")
                n = f.readinto(payload)
                if n != payload_len or f.read(1):
                    return self._refuse(path, block_hash, "truncated", f"payload of {n} bytes, header says "
                                                                       f"{payload_len}")
        except FileNotFoundError:  # removed since the last scan (by a clean-up here or elsewhere): a miss
            with self._lock:
                self._index.discard(block_hash)
            return False
        except OSError as e:
            return self._refuse(path, block_hash, "read", _os_error(e), remove=False)
        if zlib.crc32(payload, zlib.crc32(record)) != crc:
            return self._refuse(path, block_hash, "corrupt", "checksum mismatch")
        with self._lock:
            self.loaded_blocks_total += 1
            self.read_bytes_total += self.file_bytes
        self._put_nowait(("touch", block_hash))  # a hit: least recently used is by use, not by write
        return True

    def read_async(self, blocks: Sequence[tuple[int, torch.Tensor]], done: Callable[[int, bool], None],
                   after: Callable[[], None] | None = None) -> None:
        """Read ``blocks`` ((hash, a contiguous host block to read it into), in prefix order) on the
        reader thread, each as ``read`` does, then ``done(hash, loaded?)`` for each, from that
        thread, in order. After the first that does not load, the rest are not read (reported
        not loaded): their prefix is recomputed from there. ``after`` runs on the reader thread
        before the first write into them (the host waiting for copies still using the blocks)."""
        if self._closed:  # (no reader any more: none is read)
            for block_hash, _ in blocks:
                done(block_hash, False)
            return
        self._reads.put((list(blocks), done, after))

    @property
    def reader_alive(self) -> bool:
        """False once the reader thread died: reads given to it will never end."""
        return self._reader.is_alive() or self._closed

    def spill(self, block_hash: int, block: torch.Tensor) -> bool:
        """The host tier drops ``block`` (its KV, readable now): copy it to a staging buffer and
        queue its write. False when dropped (no staging buffer free, or closed). A block whose
        file is here already is only touched."""
        if self._closed:
            return False
        if block_hash in self._index:
            self._put_nowait(("touch", block_hash))
            return True
        with self._lock:
            idx = self._free_staging.pop() if self._free_staging else None
        if idx is None:
            self.dropped_spills_total += 1
            return False
        self._staging[idx].copy_(block)
        if not self._put_nowait(("write", block_hash, idx)):  # (touches fill the queue at most)
            with self._lock:
                self._free_staging.append(idx)
            self.dropped_spills_total += 1
            return False
        return True

    def stats(self) -> DiskTierStats:
        return DiskTierStats(self.size_bytes, self.used_bytes, len(self._index), self.stored_blocks_total,
                             self.loaded_blocks_total, self.read_bytes_total, self.written_bytes_total,
                             self.dropped_spills_total, self.removed_files_total, dict(self.errors))

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued write and touch is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Finish the queued writes and stop the writer and the reader (reads still queued are
        reported not loaded, unread). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reads.put(None)
        self._queue.put(None)
        self._thread.join(timeout=30.0)
        self._reader.join(timeout=30.0)

    # ---- faults ----------------------------------------------------------
    def _count(self, cause: str, detail: str) -> None:
        with self._lock:  # (both threads count)
            self.errors[cause] += 1
            first = cause not in self._logged
            self._logged.add(cause)
        if first:  # once per cause: a full disk must not flood the log
            logger.warning("KV disk tier (%s): %s; that block is recomputed where needed (further such errors are only "
                           "counted: pdserve:kv_offload_disk_errors{cause=%r})", self.root, detail, cause)

    def _refuse(self, path: Path, block_hash: int, cause: str, detail: str, remove: bool = True) -> bool:
        self._count(cause, f"refused {path.name}: {detail}")
        with self._lock:
            self._index.discard(block_hash)
        if remove:
            try:
                os.unlink(path)
            except OSError:
                pass
        return False

    def _put_nowait(self, item: tuple) -> bool:
        if self._closed:
            return False
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    # ---- the reader thread -----------------------------------------------
    def _read_loop(self) -> None:
        serial_thread()
        while True:
            job = self._reads.get()
            if job is None:
                return
            blocks, done, after = job
            ok = not self._closed
            if ok and after is not None:
                try:
                    after()
                except Exception:  # (nothing may be written into blocks still in use)
                    logger.exception("KV disk tier reader: waiting for the host's copies")
                    ok = False
            for block_hash, out in blocks:
                if ok:
                    try:
                        ok = self.read(block_hash, out)
                    except Exception as e:  # the reader must outlive any one file's trouble
                        self._count("read", f"reading {self.file_of(block_hash).name}: {e!r}")
                        ok = False
                try:
                    done(block_hash, ok)
                except Exception:
                    logger.exception("KV disk tier reader: reporting a read")

    # ---- the writer thread -----------------------------------------------
    def _writer(self) -> None:
        serial_thread()
        while True:
            try:
                item = self._queue.get(timeout=max(0.01, self._next_scan - time.monotonic()))
            except queue.Empty:
                item = ()
            try:
                if item is None:
                    return
                if item and item[0] == "write":
                    self._write(item[1], item[2])
                elif item:
                    self._touch(item[1])
                if time.monotonic() >= self._next_scan:
                    self._rescan()
            except Exception:  # the writer must outlive any one file's trouble
                logger.exception("KV disk tier writer")
            finally:
                if item != ():
                    self._queue.task_done()

    def _write(self, block_hash: int, idx: int) -> None:
        try:
            if block_hash in self._index:
                self._touch(block_hash)
                return
            self._make_room(self.file_bytes)
            payload = self._staging[idx].view(-1).view(torch.uint8).numpy()
            crc = zlib.crc32(payload, zlib.crc32(self.record))
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(self.record), block_hash, self.payload_bytes, crc)
            final = self.file_of(block_hash)
            tmp = self.dir / f"{TMP_PREFIX}{block_hash:016x}-{os.getpid()}-{threading.get_ident()}"
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(header)
                    f.write(self.record)
                    f.write(payload)
                os.replace(tmp, final)
            except OSError as e:
                cause = "no_space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "write"
                self._count(cause, f"writing {final.name}: {_os_error(e)}")
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                return
            with self._lock:
                self._index.add(block_hash)
                self._files[str(final)] = self.file_bytes
                self._files.move_to_end(str(final))
            self.used_bytes += self.file_bytes
            self.stored_blocks_total += 1
            self.written_bytes_total += self.file_bytes
        finally:
            with self._lock:
                self._free_staging.append(idx)

    def _touch(self, block_hash: int) -> None:
        path = str(self.file_of(block_hash))
        try:
            os.utime(path)
        except OSError:
            return
        if path in self._files:
            self._files.move_to_end(path)

    def _make_room(self, nbytes: int) -> None:
        """Remove the least recently used files of DIR (any layout's) until ``nbytes`` more fit
        under the bound, down to ``LOW_WATER`` of it; rescan first (other servers write too)."""
        if self.used_bytes + nbytes <= self.size_bytes:
            return
        self._rescan()
        target = min(self.size_bytes - nbytes, int(self.size_bytes * LOW_WATER))
        while self.used_bytes > target and self._files:
            path, size = self._files.popitem(last=False)
            try:
                os.unlink(path)
                self.removed_files_total += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                self._count("write", f"removing {Path(path).name}: {_os_error(e)}")
            self.used_bytes -= size
            if path.startswith(str(self.dir)) and path.endswith(SUFFIX):
                with self._lock:
                    self._index.discard(_hash_of(Path(path).name))

    def _rescan(self) -> None:
        """Read DIR again: every file's size and age (the clean-up's order), this layout's
        hashes (the index), stale temporary files removed."""
        self._next_scan = time.monotonic() + self.rescan_s
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            entries = []
            now = time.time()
            for sub in os.scandir(self.root):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for e in os.scandir(sub.path):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed meanwhile
                    if e.name.startswith(TMP_PREFIX) and now - st.st_mtime > STALE_TMP_S:
                        try:
                            os.unlink(e.path)
                        except OSError:
                            pass
                        continue
                    entries.append((st.st_mtime, e.path, st.st_size, sub.path == str(self.dir), e.name))
        except OSError as e:
            self._count("directory", f"scanning: {_os_error(e)}")
            return
        entries.sort()
        files = OrderedDict((path, size) for _, path, size, _, _ in entries)
        index = {_hash_of(name) for _, _, _, ours, name in entries if ours and name.endswith(SUFFIX)}
        index.discard(None)
        with self._lock:
            self._files, self._index = files, index  # type: ignore[assignment]
        self.used_bytes = sum(files.values())


def _hash_of(name: str) -> int | None:
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    try:
        return int(stem, 16) if len(stem) == 16 else None
    except ValueError:
        return None


def _os_error(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return f"{name} {e.strerror or e}".strip()


def _record_diff(got: bytes, want: bytes, f: Any, record_len: int) -> str:
    """Which fields of a foreign file's layout record differ from this server's (for the log)."""
    try:
        if len(got) < record_len:  # a longer record than ours: read the rest
            got += f.read(record_len - len(got))
        theirs, ours = json.loads(got[:record_len]), json.loads(want)
        diffs = [f"{k}: {theirs.get(k)!r} here {ours.get(k)!r}" for k in sorted(set(theirs) | set(ours))
                 if theirs.get(k) != ours.get(k)]
        return "another layout (" + "; ".join(diffs)[:400] + ")"
    except (ValueError, OSError, UnicodeDecodeError):
        return "another layout (an unreadable record)"


__all__ = ["DiskKVTier", "DiskTierStats", "FORMAT_VERSION", "CAUSES", "checkpoint_identity", "layout_record"]
