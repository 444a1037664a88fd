"""Wire types: how one field is checked when decoded and dumped when encoded.

Each wire type turns a decoded msgpack value into its Python form (``load``), raising
``RemoteProtocolError`` with the field's path, and turns the Python form back into a
msgpack-ready value (``dump``). Records (small structs inside a message) travel as
msgpack arrays in declared field order; trailing fields added by later versions carry
defaults, so an older sender's shorter array still decodes.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.limits import Limits

T = TypeVar("T")

_MISSING: Any = object()
U64_MAX = (1 << 64) - 1


class WireType(Generic[T]):
    """Base of all wire types."""

    def load(self, value: Any, path: str, limits: Limits) -> T:
        raise NotImplementedError

    def dump(self, value: T) -> Any:
        return value


def _fail(code: ErrorCode, reason: str, path: str) -> RemoteProtocolError:
    return RemoteProtocolError(code, reason, path)


def _check_count(count: int, maximum: int, minimum: int, unit: str, over: ErrorCode, path: str) -> None:
    """A size between ``minimum`` and ``maximum``: above it ``over``, below it ``OUT_OF_RANGE``."""
    if count > maximum:
        raise _fail(over, f"{count} {unit}, limit {maximum}", path)
    if count < minimum:
        raise _fail(ErrorCode.OUT_OF_RANGE, f"{count} {unit}, at least {minimum} needed", path)


class UInt(WireType[int]):
    """An unsigned integer no larger than ``maximum``."""

    def __init__(self, maximum: int = U64_MAX) -> None:
        self.maximum = maximum

    def load(self, value: Any, path: str, limits: Limits) -> int:
        if type(value) is not int:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected an unsigned integer, got {_tname(value)}", path)
        if value < 0 or value > self.maximum:
            raise _fail(ErrorCode.OUT_OF_RANGE, f"{value} is outside 0..{self.maximum}", path)
        return value

    def load_many(self, values: list[Any], limits: Limits) -> tuple[int, ...] | None:
        """A whole array in a few C-level passes; None when one item fails (the caller names it)."""
        if not values:
            return ()
        if set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= self.maximum:
            return tuple(values)
        return None


class Bool(WireType[bool]):
    """A msgpack boolean (not an integer)."""

    def load(self, value: Any, path: str, limits: Limits) -> bool:
        if type(value) is not bool:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected a boolean, got {_tname(value)}", path)
        return value


class Bytes(WireType[bytes]):
    """A msgpack bin of at most ``limit`` bytes (a field of ``Limits``), at least ``minimum``."""

    def __init__(self, limit: str, minimum: int = 0) -> None:
        self.limit = limit
        self.minimum = minimum

    def load(self, value: Any, path: str, limits: Limits) -> bytes:
        if type(value) is not bytes:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected bin, got {_tname(value)}", path)
        _check_count(len(value), getattr(limits, self.limit), self.minimum, "bytes", ErrorCode.TOO_LARGE, path)
        return value

    def load_many(self, values: list[Any], limits: Limits) -> tuple[bytes, ...] | None:
        """A whole array of bins (keys) in a few C-level passes; None when one item fails.

        ``values`` come from msgpack, whose only bytes-like objects are bins (bytes): joining
        them checks every item's type in one C call.
        """
        if not values:
            return ()
        try:
            b"".join(values)
        except TypeError:
            return None
        sizes = set(map(len, values))
        if min(sizes) < self.minimum or max(sizes) > getattr(limits, self.limit):
            return None
        return tuple(values)


class Str(WireType[str]):
    """A msgpack str of at most ``limit`` UTF-8 bytes, optionally one of ``choices``."""

    def __init__(self, limit: str, choices: Sequence[str] | None = None) -> None:
        self.limit = limit
        self.choices = frozenset(choices) if choices is not None else None

    def load(self, value: Any, path: str, limits: Limits) -> str:
        if type(value) is not str:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected str, got {_tname(value)}", path)
        maximum: int = getattr(limits, self.limit)
        if len(value) > maximum or len(value.encode("utf-8", "surrogatepass")) > maximum:
            raise _fail(ErrorCode.TOO_LARGE, f"longer than {maximum} bytes", path)
        if self.choices is not None and value not in self.choices:
            raise _fail(ErrorCode.OUT_OF_RANGE, f"{value!r} is not one of {sorted(self.choices)}", path)
        return value

    def load_many(self, values: list[Any], limits: Limits) -> tuple[str, ...] | None:
        """A whole array of short strs (a tier table) in a few C-level passes; None when one
        item might fail (the caller then checks them one by one, naming the bad one)."""
        if not values:
            return ()
        if self.choices is not None or set(map(type, values)) != {str}:
            return None
        # At most 4 UTF-8 bytes a character: no str this short can be too long.
        if max(map(len, values)) * 4 > getattr(limits, self.limit):
            return None
        return tuple(values)


E = TypeVar("E", bound=enum.Enum)


class EnumStr(WireType[E]):
    """A str enum travelling as its value."""

    def __init__(self, enum_type: type[E]) -> None:
        self.enum_type = enum_type
        self.by_value = {m.value: m for m in enum_type}

    def load(self, value: Any, path: str, limits: Limits) -> E:
        if type(value) is not str:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected str, got {_tname(value)}", path)
        member = self.by_value.get(value)
        if member is None:
            raise _fail(ErrorCode.OUT_OF_RANGE, f"{value[:64]!r} is not one of {sorted(self.by_value)}", path)
        return member

    def dump(self, value: E) -> Any:
        return value.value


class Opt(WireType["T | None"]):
    """``nil`` or the inner type."""

    def __init__(self, inner: WireType[T]) -> None:
        self.inner = inner

    def load(self, value: Any, path: str, limits: Limits) -> T | None:
        return None if value is None else self.inner.load(value, path, limits)

    def dump(self, value: T | None) -> Any:
        return None if value is None else self.inner.dump(value)


class Seq(WireType[tuple[T, ...]]):
    """A msgpack array of at most ``limit`` items (a field of ``Limits``), loaded as a tuple."""

    def __init__(self, item: WireType[T], limit: str, minimum: int = 0) -> None:
        self.item = item
        self.limit = limit
        self.minimum = minimum
        # Records of plain fields load a whole array in one generated loop.
        self.load_many: Callable[[Any, Limits], Any] | None = getattr(item, "load_many", None)
        # Items that dump as themselves (keys, ints, strs): the array dumps as itself.
        self.plain = type(item).dump is WireType.dump

    def load(self, value: Any, path: str, limits: Limits) -> tuple[T, ...]:
        if type(value) is not list:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected array, got {_tname(value)}", path)
        _check_count(len(value), getattr(limits, self.limit), self.minimum, "items", ErrorCode.TOO_MANY, path)
        load_many = self.load_many
        if load_many is not None:
            loaded = load_many(value, limits)
            if loaded is not None:
                return loaded  # type: ignore[no-any-return]
        load = self.item.load
        out = []
        i = 0
        try:
            # Items get an empty path; the failing one's index is added only on error,
            # so a valid message costs no path formatting.
            for v in value:
                out.append(load(v, "", limits))
                i += 1
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(exc.code, exc.reason, f"{path}[{i}]{exc.path}") from None
        return tuple(out)

    def dump(self, value: tuple[T, ...]) -> Any:
        if self.plain:
            return value
        dump = self.item.dump
        return [dump(v) for v in value]


class Packed(WireType[bytes]):
    """A msgpack bin of little-endian unsigned integers, ``width`` bytes each (a column).

    At most ``limit`` (a field of ``Limits``) integers. It loads as the bytes themselves:
    a column costs one C call to read, whatever its length (spec section 6.7).
    """

    def __init__(self, width: int, limit: str) -> None:
        self.width = width
        self.limit = limit

    def load(self, value: Any, path: str, limits: Limits) -> bytes:
        if type(value) is not bytes:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected bin, got {_tname(value)}", path)
        count, rest = divmod(len(value), self.width)
        if rest:
            raise _fail(ErrorCode.OUT_OF_RANGE, f"{len(value)} bytes is not a whole number of {self.width}-byte integers", path)
        _check_count(count, getattr(limits, self.limit), 0, "integers", ErrorCode.TOO_MANY, path)
        return value


class UIntOrPacked(WireType["int | bytes"]):
    """One unsigned integer for every entry (at most ``maximum``), or a ``Packed`` column of them."""

    def __init__(self, maximum: int, width: int, limit: str) -> None:
        self.uint = UInt(maximum)
        self.packed = Packed(width, limit)

    def load(self, value: Any, path: str, limits: Limits) -> int | bytes:
        if type(value) is bytes:
            return self.packed.load(value, path, limits)
        if type(value) is not int:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected an unsigned integer or bin, got {_tname(value)}", path)
        return self.uint.load(value, path, limits)


NUL = "\0"
"""The separator of a ``Joined`` column; no name in one may contain it."""

_JOINED_MEMO_SIZE = 64
"""Joined columns remembered as validated (a deployment has few layouts)."""


class Joined(WireType[str]):
    """A msgpack str holding names joined by NUL (U+0000): n names, n - 1 separators.

    Each name is at most ``limit`` UTF-8 bytes (a field of ``Limits``), and there are at
    most ``max_spans`` names. The column of one layout repeats in every message that
    names it, so the validated split is remembered (bounded): a repeat costs one lookup.
    """

    def __init__(self, limit: str) -> None:
        self.limit = limit
        self._memo: dict[tuple[str, int], tuple[str, ...]] = {}

    def load(self, value: Any, path: str, limits: Limits) -> str:
        if type(value) is not str:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected str, got {_tname(value)}", path)
        self.split(value, path, limits)
        return value

    def split(self, value: str, path: str, limits: Limits) -> tuple[str, ...]:
        """The names of a column, checked against ``limits``."""
        maximum: int = getattr(limits, self.limit)
        memo_key = (value, maximum)
        names = self._memo.get(memo_key)
        if names is not None:
            return names
        names = tuple(value.split(NUL))
        _check_count(len(names), limits.max_spans, 1, "names", ErrorCode.TOO_MANY, path)
        for i, name in enumerate(names):
            if len(name) * 4 > maximum and len(name.encode("utf-8", "surrogatepass")) > maximum:
                raise _fail(ErrorCode.TOO_LARGE, f"name {i} is longer than {maximum} bytes", f"{path}[{i}]")
        if len(self._memo) >= _JOINED_MEMO_SIZE:
            self._memo.clear()
        self._memo[memo_key] = names
        return names

    def count(self, value: str) -> int:
        """How many names a column holds, without splitting it."""
        return value.count(NUL) + 1


class AnyMap(WireType[dict[str, Any]]):
    """A map with str keys and arbitrary msgpack values (statistics)."""

    def load(self, value: Any, path: str, limits: Limits) -> dict[str, Any]:
        if type(value) is not dict:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected map, got {_tname(value)}", path)
        for k in value:
            if type(k) is not str:
                raise _fail(ErrorCode.WRONG_TYPE, "map keys must be str", path)
        return value


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a message or record: its attribute, wire type, default and version."""

    name: str
    type: WireType[Any]
    default: Any = _MISSING
    since: int = 1
    must_understand: bool = False
    sparse: bool = False
    """An optional field that travels only when set (as a must-understand one does), so that a
    message that does not use it keeps the bytes it had before the field existed."""

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    @property
    def key(self) -> str:
        """The map key on the wire: must-understand fields are prefixed with ``!``."""
        return "!" + self.name if self.must_understand else self.name


class Record:
    """Base of small structs that travel as arrays; subclasses declare ``FIELDS``.

    Spans, which come by the thousand, are tuple subclasses (a ``NamedTuple`` base):
    a decoded msgpack array becomes one with a single C call, and encodes as itself.
    """

    __slots__ = ()
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    CHECKED: ClassVar[bool] = False
    """True for records whose fields must agree with each other (``check`` runs after loading)."""

    def check(self, limits: Limits) -> None:
        """Raise ``RemoteProtocolError`` (path relative to the record) if the fields disagree."""


R = TypeVar("R", bound=Record)

_FastLoad = Callable[[Any, Limits], Any]


def _fast_loaders(cls: type[Any], fields: tuple[Field, ...]) -> tuple[_FastLoad, _FastLoad, bool] | None:
    """Generated loaders (one item, many items) for records of simple fields, else None.

    Simple fields are uints, strs without choices, str enums and optional uints. The
    loaders check exactly what the field types check, inline, with no call per field;
    they return None at the first item that does not pass, and the caller then takes
    the full path, which names the bad field. Generated once per record class. The
    third value says whether every field is a plain uint or str (it dumps as itself).
    """
    names = [f"a{i}" for i in range(len(fields))]
    checks: list[str] = []
    args: list[str] = []
    limits_used: set[str] = set()
    namespace: dict[str, Any] = {"cls": cls, "new": tuple.__new__}
    for i, (name, f) in enumerate(zip(names, fields, strict=True)):
        t = f.type
        arg = name
        if type(t) is UInt:
            checks.append(f"type({name}) is int and 0 <= {name} <= {t.maximum}")
        elif type(t) is Str and t.choices is None:
            limits_used.add(t.limit)
            # At most 4 UTF-8 bytes a character: encode only when it could matter.
            checks.append(
                f"type({name}) is str and (len({name}) * 4 <= m_{t.limit}"
                f" or len({name}.encode('utf-8', 'surrogatepass')) <= m_{t.limit})"
            )
        elif type(t) is EnumStr:
            namespace[f"members{i}"] = t.by_value
            arg = f"e{i}"
            checks.append(f"type({name}) is str and ({arg} := members{i}.get({name})) is not None")
        elif type(t) is Opt and type(t.inner) is UInt:
            checks.append(f"{name} is None or (type({name}) is int and 0 <= {name} <= {t.inner.maximum})")
        else:
            return None
        args.append(arg)
    plain = args == names
    tuple_based = issubclass(cls, tuple)
    if tuple_based:
        make = "new(cls, v)" if plain else f"new(cls, ({', '.join(args)},))"
    else:
        make = f"cls({', '.join(args)})"
    unpack = f"{', '.join(names)}, = v"
    cond = " and ".join(f"({c})" for c in checks)
    head = "".join(f"    m_{lim} = limits.{lim}\n" for lim in sorted(limits_used))
    source = (
        "def load_one(v, limits):\n" + head
        + f"    if type(v) is list and len(v) == {len(fields)}:\n"
        + f"        {unpack}\n"
        + f"        if {cond}:\n"
        + f"            return {make}\n"
        + "    return None\n"
        + "def load_many(values, limits):\n" + head
        + "    out = []\n    append = out.append\n"
        + "    for v in values:\n"
        + f"        if type(v) is not list or len(v) != {len(fields)}:\n"
        + "            return None\n"
        + f"        {unpack}\n"
        + f"        if not ({cond}):\n"
        + "            return None\n"
        + f"        append({make})\n"
        + "    return tuple(out)\n"
    )
    exec(compile(source, f"<kvcr record loader {cls.__name__}>", "exec"), namespace)
    return namespace["load_one"], namespace["load_many"], plain


class RecordType(WireType[R]):
    """A record as a msgpack array in ``FIELDS`` order; trailing defaults may be omitted."""

    def __init__(self, cls: type[R]) -> None:
        self.cls = cls
        self.fields = cls.FIELDS
        self.n_required = sum(1 for f in self.fields if f.required)
        self.tuple_based = issubclass(cls, tuple)
        # A record whose fields must agree is always loaded field by field, then checked.
        loaders = None if cls.CHECKED else _fast_loaders(cls, self.fields)
        self.load_one: _FastLoad | None = loaders[0] if loaders else None
        self.load_many: _FastLoad | None = loaders[1] if loaders else None
        self.plain = loaders[2] if loaders else False
        self.getter = operator.attrgetter(*(f.name for f in self.fields))

    def load(self, value: Any, path: str, limits: Limits) -> R:
        if self.load_one is not None:
            record = self.load_one(value, limits)
            if record is not None:
                return record  # type: ignore[no-any-return]
        if type(value) is not list:
            raise _fail(ErrorCode.WRONG_TYPE, f"expected array ({self.cls.__name__}), got {_tname(value)}", path)
        if len(value) < self.n_required:
            missing = self.fields[len(value)].name
            raise _fail(ErrorCode.MISSING_FIELD, f"{self.cls.__name__} needs {self.n_required} items", f"{path}.{missing}")
        args = []
        n = len(value)
        f = self.fields[0]
        try:
            for i, f in enumerate(self.fields):
                args.append(f.type.load(value[i], "", limits) if i < n else f.default)
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(exc.code, exc.reason, f"{path}.{f.name}{exc.path}") from None
        # Items beyond the known fields come from a newer version: ignored.
        record = self.cls(*args)
        if self.cls.CHECKED:
            try:
                record.check(limits)
            except RemoteProtocolError as exc:
                raise RemoteProtocolError(exc.code, exc.reason, f"{path}{exc.path}") from None
        return record

    def dump(self, value: R) -> Any:
        if self.plain:
            # Plain uints and strs dump as themselves: a tuple-based record is already the
            # array msgpack writes; others become the tuple of their fields.
            return value if self.tuple_based else self.getter(value)
        return [f.type.dump(getattr(value, f.name)) for f in self.fields]


def _tname(value: Any) -> str:
    return {
        int: "integer", bool: "boolean", str: "str", bytes: "bin", list: "array",
        dict: "map", float: "float", type(None): "nil",
    }.get(type(value), type(value).__name__)
