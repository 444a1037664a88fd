"""The journal of what is READY in a node's kept pools (architecture §8).

With a state directory (``kvcr_node.state_dir``), every object that becomes READY in pools
that outlive the process, and every such object that leaves, is a record appended to the
journal: written before anyone is told of it (the node flushes the journal before it sends
anything, ``Node._send_out``), and a removal at once, before its slots can be written
again. Objects still WRITING are never recorded.

A record is a frame: its length (u32), a CRC32C (u32, ``google-crc32c``) of the length
and the body, and the body, msgpack ``[kind, seq, incarnation, key, layout, slots,
digests]`` (a removal: ``[kind, seq, incarnation, key]``). ``seq`` counts up across the
records of one directory; ``incarnation`` is the node that wrote it. A record of a copy in
the disk tier (architecture §9) has one more field, ``origin``: per span, the memory pool
the object is read back into. A record of an object whose deposit named a parent (spec
section 6.4) has ``origin`` (nil outside the disk tier) and then ``parent``, so that a
restarted node publishes its objects with their parents.

Files, by generation ``g``: ``journal.g`` takes appends; ``snapshot.g`` holds one READY
record per object the journal held when generation ``g`` began. Each file begins with its
magic and the epochs of the pools' files it describes (``file_head``, ``kvcr_node.state_dir``). A node's state is the
newest snapshot, then every journal of that generation or later, in order. Compaction
starts a generation: appends go to the new journal at once, and a background thread writes
the snapshot (to a temporary name, renamed when whole) and then deletes the older files,
so a node killed at any point leaves a state that reads back whole.

Bounds: a journal is compacted once it is larger than ``compact_bytes`` and than the
records of what it holds; so the files hold at most about twice the records of the
objects in the pools, plus ``compact_bytes``. Records last only as long as the pools'
memory: no write is synced to disk (a process that dies leaves its writes in the page
cache; a host that restarts has lost the pools anyway). A write that fails (a full disk)
is counted and logged; the journal's files are then deleted, so that a restart starts
empty rather than from a journal with a hole, and the next record starts a new
generation from the objects held then.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import google_crc32c
import msgpack

from kvcr_node.logs import Limiter
from kvcr_node.objects import ObjectEntry

log = logging.getLogger("kvcr.node")

FAILURE_LOG_S = 10.0
"""A journal's failed writes are logged once this often at most: after a failure every record
tries again, so a full disk or a directory gone fails them all (each is counted)."""
failure_log = Limiter(burst=1, window=FAILURE_LOG_S)
COMPACT_BYTES = 64 << 20
"""A journal file grows to at least this many bytes before it is compacted."""
_HEAD = struct.Struct("<II")
"""A frame's head: the body's length and the CRC32C of the length and the body."""
MAX_RECORD = 16 << 20
"""A frame whose head says more is corrupt (a key and a layout are far smaller)."""
FILE_MAGIC = b"KVCRJNL1"
"""The first bytes of every journal and snapshot file (the state version is 1)."""
_NAME = re.compile(r"^(journal|snapshot)\.(\d{8})$")


class RecordKind(enum.IntEnum):
    READY = 0
    REMOVED = 1


class Dropped(enum.Enum):
    """Why a record, or the object it named, was not adopted (``stats`` ``recovery``)."""

    TORN = "torn"
    """The file ends inside a record (the node died writing it): that record and none other."""
    CORRUPT = "corrupt"
    """The record's CRC32C does not match its bytes."""
    MALFORMED = "malformed"
    """The record's bytes check out but do not decode as a record."""
    FOREIGN = "foreign"
    """The record names a pool this node does not keep, or a slot past its pool's end."""
    POOL_LOST = "pool_lost"
    """Its pool's file was gone or of another size: the bytes are not the ones recorded."""
    SLOT_REUSED = "slot_reused"
    """A later record places another object in one of its slots."""
    DIGEST_MISMATCH = "digest_mismatch"
    """Its bytes no longer match the digests recorded with it."""


def _frame(body: bytes) -> bytes:
    head = struct.pack("<I", len(body))
    return _HEAD.pack(len(body), google_crc32c.extend(google_crc32c.value(head), body)) + body


def ready_frame(seq: int, incarnation: int, entry: ObjectEntry, origin: Origin | None = None) -> bytes:
    """The record of ``entry`` become READY (with ``origin``: a copy's, in the disk tier)."""
    layout = [list(span) for span in entry.info.layout]
    body = [RecordKind.READY, seq, incarnation, entry.key, layout, entry.packed_slots, entry.digests]
    if origin is not None or entry.parent:
        body.append(None if origin is None else list(origin))
    if entry.parent:
        body.append(entry.parent)
    return _frame(msgpack.packb(body))


def removed_frame(seq: int, incarnation: int, key: bytes) -> bytes:
    """The record of ``key``'s object gone."""
    return _frame(msgpack.packb([RecordKind.REMOVED, seq, incarnation, key]))


Layout = tuple[tuple[str, str], ...]
Origin = tuple[str, ...]
"""Per span of a disk copy, the memory pool its object is read back into."""
_READY, _REMOVED = int(RecordKind.READY), int(RecordKind.REMOVED)


class Record:
    """One decoded record. ``slots`` are packed u32, ``digests`` packed u64 (maybe empty)."""

    __slots__ = ("digests", "incarnation", "key", "kind", "layout", "origin", "parent", "seq", "slots")

    def __init__(self, body: Any, layouts: dict[Layout, Layout]) -> None:
        """``body``: the decoded msgpack (arrays as tuples); ``layouts``: the layouts seen so
        far, each checked once and shared by every record that has it."""
        kind = body[0]
        if type(kind) is not int or kind not in (_READY, _REMOVED) or type(body[1]) is not int or type(body[2]) is not int:
            raise ValueError("kind")
        self.kind = RecordKind.READY if kind == _READY else RecordKind.REMOVED
        self.seq: int = body[1]
        self.incarnation: int = body[2]
        key = body[3]
        if type(key) is not bytes:
            raise ValueError("key")
        self.key: bytes = key
        self.origin: Origin | None = None
        self.parent: bytes = b""
        if kind == _READY:
            _, _, _, _, raw, slots, digests, *rest = body
            layout = layouts.get(raw)
            if layout is None:
                if type(raw) is not tuple or not raw or not all(
                        type(span) is tuple and len(span) == 2 and type(span[0]) is str and type(span[1]) is str
                        for span in raw):
                    raise ValueError("layout")
                layout = layouts[raw] = raw
            if type(slots) is not bytes or len(slots) != 4 * len(layout) or type(digests) is not bytes:
                raise ValueError("slots")
            if digests and len(digests) != 8 * len(layout):
                raise ValueError("digests")
            if len(rest) > 2:
                raise ValueError("fields")
            if rest and rest[0] is not None:
                origin = rest[0]
                if type(origin) is not tuple or len(origin) != len(layout) or not all(type(pool) is str for pool in origin):
                    raise ValueError("origin")
                self.origin = origin
            if len(rest) == 2:
                parent = rest[1]
                if type(parent) is not bytes or not parent or parent == key:
                    raise ValueError("parent")
                self.parent = parent
            self.layout: Layout = layout
            self.slots: bytes = slots
            self.digests: bytes = digests
        else:
            self.layout, self.slots, self.digests = (), b"", b""


def read_frames(data: bytes, dropped: Callable[[Dropped], None], layouts: dict[Layout, Layout] | None = None,
                ) -> Iterator[Record]:
    """The records in one file's bytes (after its magic), in order; what cannot be read is
    reported to ``dropped``. A corrupt record is skipped by its length; a file that ends
    inside a record, or a length that cannot be, ends the file. ``layouts`` shares equal
    layouts among the records (and across files)."""
    layouts = {} if layouts is None else layouts
    head_size = _HEAD.size
    value, extend, unpack = google_crc32c.value, google_crc32c.extend, msgpack.unpackb
    at, end = 0, len(data)
    while at < end:
        if end - at < head_size:
            dropped(Dropped.TORN)
            return
        length, crc = _HEAD.unpack_from(data, at)
        if length > MAX_RECORD:
            dropped(Dropped.CORRUPT)
            return
        body_at = at + head_size
        if body_at + length > end:
            dropped(Dropped.TORN)
            return
        body = data[body_at:body_at + length]
        if extend(value(data[at:at + 4]), body) != crc:
            at = body_at + length
            dropped(Dropped.CORRUPT)
            continue
        at = body_at + length
        try:
            record = Record(unpack(body, use_list=False), layouts)
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException):
            dropped(Dropped.MALFORMED)
            continue
        yield record


def state_files(directory: Path) -> list[tuple[int, str, Path]]:
    """The journal and snapshot files in ``directory`` as (generation, kind, path), sorted."""
    out = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match:
            out.append((int(match.group(2)), match.group(1), path))
    return sorted(out, key=lambda f: (f[0], f[1] == "journal"))


def files_to_read(directory: Path) -> list[Path]:
    """The files whose records make the directory's state, in order: the newest snapshot,
    then the journals of its generation and later (all journals where there is none)."""
    files = state_files(directory)
    snapshots = [gen for gen, kind, _ in files if kind == "snapshot"]
    base = max(snapshots) if snapshots else -1
    return [path for gen, kind, path in files if (kind == "snapshot" and gen == base) or (kind == "journal" and gen >= base)]


def file_head(epochs: Mapping[str, int]) -> bytes:
    """The start of a journal or snapshot file: the magic, then the epochs of the pools' files
    its records describe (``kvcr_node.state_dir``), msgpack after its length (u32)."""
    body = msgpack.packb(dict(epochs))
    return FILE_MAGIC + struct.pack("<I", len(body)) + body


def read_file(path: Path) -> tuple[dict[str, int], bytes] | None:
    """A state file's pool epochs and its records' bytes; None when its head cannot be read."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    at = len(FILE_MAGIC) + 4
    if not data.startswith(FILE_MAGIC) or len(data) < at:
        return None
    (length,) = struct.unpack_from("<I", data, len(FILE_MAGIC))
    if length > MAX_RECORD or at + length > len(data):
        return None
    try:
        epochs = msgpack.unpackb(data[at:at + length])
    except (ValueError, msgpack.UnpackException):
        return None
    if type(epochs) is not dict or not all(type(k) is str and type(v) is int for k, v in epochs.items()):
        return None
    return epochs, data[at + length:]


def _name(kind: str, gen: int) -> str:
    return f"{kind}.{gen:08d}"


class Journal:
    """Appends the records of the node's kept objects, and compacts them in the background.

    An ``InventoryListener``: the store reports each object that becomes READY or leaves.
    ``kept(entry)`` says whether an object lives wholly in kept pools (others are not
    recorded); ``origin(entry)``, where given, the origin its record carries (a disk copy's;
    None once the copy is gone). ``flush`` writes what is pending; the node calls it before
    it sends anything.
    """

    def __init__(
        self, directory: Path, incarnation: int, epochs: Mapping[str, int], generation: int, seq: int,
        held: dict[bytes, ObjectEntry], kept: Callable[[ObjectEntry], bool], failed: Callable[[BaseException], None],
        compact_bytes: int = COMPACT_BYTES, snapshot: bool = True,
        origin: Callable[[ObjectEntry], Origin | None] | None = None,
    ) -> None:
        """Start generation ``generation`` holding ``held`` (the objects adopted), with
        records numbered from ``seq``, under the pools' ``epochs``. ``snapshot``: write the
        snapshot of ``held`` at once, in the background (and then delete the older files);
        else the older files stay, and make the state with the new journal, until the
        first compaction."""
        self.directory = directory
        self.head = file_head(epochs)
        self.incarnation = incarnation
        self.seq = seq
        self.held = held
        """Key -> entry of every object recorded READY and not removed since."""
        self.kept = kept
        self.origin = origin
        self.failed = failed
        self.compact_bytes = compact_bytes
        self.generation = generation - 1
        self.pending = bytearray()
        self.fd = -1
        self.written = 0
        """Bytes in the current journal file."""
        self._frames = 0
        self._frame_bytes = 0
        """READY records written, and their bytes: what one held object's record takes, on average."""
        self.compactions = 0
        self.write_failures = 0
        self._compacting: threading.Thread | None = None
        for stale in directory.glob("snapshot.*.tmp"):  # a compaction a killed node left half-written
            stale.unlink(missing_ok=True)
        self._start_generation(snapshot)

    # -- what the store reports (InventoryListener) -------------------------------------

    def stored(self, entry: ObjectEntry) -> None:
        if not self.kept(entry):
            return
        frame = ready_frame(self.seq, self.incarnation, entry, self.origin(entry) if self.origin is not None else None)
        self.seq += 1
        self.held[entry.key] = entry
        self._frames += 1
        self._frame_bytes += len(frame)
        self.pending += frame

    def removed(self, entry: ObjectEntry, evicted: bool) -> None:
        if self.held.get(entry.key) is not entry:
            return
        del self.held[entry.key]
        self.pending += removed_frame(self.seq, self.incarnation, entry.key)
        self.seq += 1
        # Before the slots can be written again: a record of them must not outlive this.
        self.flush()

    # -- writing ------------------------------------------------------------------------

    def flush(self) -> None:
        """Write what is pending; compact when the journal has grown past its bound."""
        if not self.pending:
            return
        if self.fd < 0:
            self.pending.clear()  # a failed journal: the generation that follows holds it all
            self._start_generation()
            return
        data, self.pending = self.pending, bytearray()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            self._fail(exc)
            return
        self.written += len(data)
        if self.written > self.compact_bytes and not self.compacting:
            held_bytes = len(self.held) * self._frame_bytes // max(1, self._frames)
            if self.written > held_bytes:
                self._start_generation()

    @property
    def compacting(self) -> bool:
        return self._compacting is not None and self._compacting.is_alive()

    def _start_generation(self, snapshot: bool = True) -> None:
        """Appends go to a new journal file; the snapshot of what is held now is written in
        the background, and then the older files go (``snapshot``)."""
        if self.compacting:
            return  # the running one ends first; ``flush`` tries again
        self.generation += 1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        path = self.directory / _name("journal", self.generation)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            os.write(fd, self.head)
        except OSError as exc:
            self._fail(exc)
            return
        self.fd, self.written = fd, 0
        if not snapshot:
            return
        entries = list(self.held.values())
        thread = threading.Thread(
            target=self._write_snapshot, args=(self.generation, entries, self.incarnation), name="kvcr-journal",
            daemon=True)
        self._compacting = thread
        thread.start()

    def _write_snapshot(self, generation: int, entries: list[ObjectEntry], incarnation: int) -> None:
        """Runs on the compaction thread: reads only what never changes on a READY entry."""
        tmp = self.directory / (_name("snapshot", generation) + ".tmp")
        try:
            with open(tmp, "wb") as out:
                out.write(self.head)
                origin = self.origin
                for entry in entries:
                    # A snapshot record has seq 0: order among them does not matter.
                    if origin is None:
                        out.write(ready_frame(0, incarnation, entry))
                        continue
                    # A copy gone since the generation began has no origin: its removal is
                    # in this generation's journal, and its record can go unwritten.
                    of = origin(entry)
                    if of is not None:
                        out.write(ready_frame(0, incarnation, entry, of))
            tmp.replace(self.directory / _name("snapshot", generation))
            for gen, _, path in state_files(self.directory):
                if gen < generation:
                    path.unlink(missing_ok=True)
            self.compactions += 1
        except OSError as exc:
            log.error("journal: the snapshot of generation %d could not be written: %s", generation, exc)
            tmp.unlink(missing_ok=True)
            self.write_failures += 1

    def _fail(self, exc: OSError) -> None:
        """A write failed: delete the journal (a restart starts empty, never from a journal
        with a hole); the next record starts a generation from what is held then."""
        self.write_failures += 1
        self.failed(exc)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.settle()
        try:
            files = state_files(self.directory)
        except OSError:
            return  # the directory itself is gone: so are its files
        for _, _, path in files:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def stats(self) -> dict[str, int]:
        """``stats`` ``journal``: the generation, objects held, bytes in the journal file, compactions, failures."""
        return {"generation": self.generation, "held": len(self.held), "bytes": self.written,
                "compactions": self.compactions, "write_failures": self.write_failures}

    def settle(self) -> None:
        """Wait for a running compaction to end."""
        if self._compacting is not None:
            self._compacting.join()

    def close(self) -> None:
        """Write what is pending and wait for a running compaction."""
        self.flush()
        self.settle()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def close_stopping(journal: Journal, what: str) -> None:
    """Close ``journal`` as its node stops (its last records written): an ``OSError`` (a full or
    vanished disk) is logged, naming ``what``, not raised, so that the rest of the node closes."""
    try:
        journal.close()
    except OSError as exc:
        log.error("%s: cannot close its journal: %s", what, exc)
