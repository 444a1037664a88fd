"""The disk tier's read backs in flight (architecture §9): cut into pieces, read a bounded
number of bytes at a time, in order, and each object finished once its last piece is in.

A deliver of objects held on disk only reads them back into memory before it sends them,
and every read back is checked against its digests first. Read all at once, they all end
together, when the disk has read the last byte, and only then does the node check and send
any of them: the checking and the deliver's copies come after the disk's time instead of
under it. So the read backs go as pieces of at most ``READ_BACK_CHUNK_BYTES`` (several
small objects, or a part of a large one), in the order the operations asked for them, with
at most ``READ_BACK_BYTES_IN_FLIGHT`` being read at once: the first pieces are in early,
and each piece's spans are checked, and each finished object is handed on, while the disk
reads the next. A piece goes as soon as it is full, so the disk reads the first read backs
of a large deliver while the node places the rest; the last, partly filled, goes at the end
of the turn (``seal``).

Pure: no I/O, no clock. The node's ``Tiering`` posts each piece (its moves come from the
``moves`` it is given) and reports its end.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcr_node.disk_tier import Promotion

READ_BACK_CHUNK_BYTES = 4 << 20
"""Bytes one piece carries at most (one span at least): a large object is read as several
pieces, small ones several to a piece."""
READ_BACK_BYTES_IN_FLIGHT = 16 << 20
"""Bytes being read back at once, at most (one piece at least). Four pieces in flight keep
the disk's queue full (each is tens of requests of a span each), and the first of them is in
after a quarter of what all at once would take."""

Segment = tuple[Promotion, int, int]
"""Spans ``first`` to ``end - 1`` of a read back (in its object's layout order)."""
Intact = Callable[[Promotion, int, int], bool]
"""Whether spans ``first`` to ``end - 1`` of a read back, just read, match their digests."""


@dataclass(eq=False)
class Piece:
    """One transfer of read backs: spans of one or several objects, in order."""

    segments: list[Segment] = field(default_factory=list)
    size: int = 0


@dataclass(eq=False)
class _Reading:
    """A read back whose pieces are not all in yet."""

    left: int = 0
    read: bool = True
    """Every piece of it ended well so far."""
    intact: bool = True
    """Every span of it read so far matched its digest."""


@dataclass(frozen=True)
class Finished:
    """A read back whose last piece is in: ``read`` (every piece ended well) and ``intact``
    (every span matched its digest; False too where a piece failed)."""

    promotion: Promotion
    read: bool
    intact: bool


class ReadBacks:
    """The read backs waiting to be read and being read, by piece."""

    def __init__(
        self, span_bytes: Callable[[Promotion], Sequence[int]], chunk_bytes: int = READ_BACK_CHUNK_BYTES,
        in_flight_bytes: int = READ_BACK_BYTES_IN_FLIGHT,
    ) -> None:
        self.span_bytes = span_bytes
        """The bytes of each span of a read back, in layout order."""
        self.chunk_bytes = chunk_bytes
        self.in_flight_bytes = in_flight_bytes
        self.queued: collections.deque[Piece] = collections.deque()
        self.reading = 0
        """Bytes of the pieces posted and not yet ended."""
        self.posted = 0
        """Pieces posted and not yet ended."""
        self._open: dict[Promotion, _Reading] = {}
        self._filling: Piece | None = None
        """The last piece, not full: the next read backs added go on into it."""

    def __len__(self) -> int:
        """Read backs not finished."""
        return len(self._open)

    def add(self, promotions: Sequence[Promotion]) -> None:
        """Queue ``promotions``, in order: small ones share a piece, a large one is cut. A
        piece is queued once full; the last one takes the next read backs added, until
        ``seal``."""
        piece = self._filling
        for promotion in promotions:
            sizes = self.span_bytes(promotion) or (0,)  # an object has spans; none would never finish
            reading = self._open[promotion] = _Reading()
            first = 0
            while first < len(sizes):
                if piece is None or piece.size + sizes[first] > self.chunk_bytes:
                    if piece is not None:
                        self.queued.append(piece)
                    piece = Piece()
                end, size = first, piece.size
                while end < len(sizes) and (end == first or size + sizes[end] <= self.chunk_bytes):
                    size += sizes[end]
                    end += 1
                piece.segments.append((promotion, first, end))
                piece.size = size
                reading.left += 1
                first = end
        self._filling = piece

    def seal(self) -> None:
        """No more read backs come this turn: the piece still taking them is queued as it is."""
        if self._filling is not None:
            self.queued.append(self._filling)
            self._filling = None

    def next(self) -> list[Piece]:
        """The pieces to post now, in order: as many as keep the bytes being read within
        ``in_flight_bytes`` (one at least while nothing is)."""
        out: list[Piece] = []
        queued = self.queued
        while queued and (not self.posted or self.reading + queued[0].size <= self.in_flight_bytes):
            piece = queued.popleft()
            self.reading += piece.size
            self.posted += 1
            out.append(piece)
        return out

    def landed(self, piece: Piece) -> None:
        """``piece``'s transfer ended (well or not): its bytes leave the bound; ``next``
        then has more to post. Its spans are looked at by ``ended``, after."""
        self.reading -= piece.size
        self.posted -= 1

    def ended(self, piece: Piece, ok: bool, intact: Intact) -> list[Finished]:
        """Look at ``piece``'s spans (``ok``: its transfer ended well): each checked with
        ``intact`` unless its object failed already; the read backs it finished."""
        finished: list[Finished] = []
        for promotion, first, end in piece.segments:
            reading = self._open[promotion]
            if not ok:
                reading.read = reading.intact = False
            elif reading.intact and not intact(promotion, first, end):
                reading.intact = False
            reading.left -= 1
            if not reading.left:
                del self._open[promotion]
                finished.append(Finished(promotion, reading.read, reading.intact))
        return finished
