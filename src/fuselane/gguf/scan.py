"""A bounded scan of a GGUF header: every count and length is checked against the bytes present first.

A GGUF header is a sequence of self-described values: counts and lengths that the file claims, followed by
that many items. A reader that trusts them (as `gguf.GGUFReader` does) can be sent into a 2^63-step loop or
a 2^63-byte allocation by a file of a few dozen bytes. This scan never allocates or loops on a claimed number
before checking that the bytes those items need at the very least are actually in the file, and that the
number is within a sane bound (`MAX_KV_COUNT`, `MAX_TENSOR_COUNT`, `MAX_STRING_ELEMENTS`,
`MAX_ARRAY_ELEMENTS`), so its time and memory are bounded by the real file size whatever the file says.

The scan also converts the metadata to Python values on the way (it has to walk every byte of it anyway), so
the reader does not need a second pass. It reports structure only; what the tensors mean (formats, block
sizes, alignment, overlap) is checked by `fuselane.gguf.reader`.

The format constants (magic, value types, supported versions) come from the `gguf` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
from gguf.constants import GGUF_MAGIC, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from fuselane.errors import GgufError

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
MAGIC_BYTES = _U32.pack(GGUF_MAGIC)
# A file written on a big-endian host stores the version byte-swapped, so its low 16 bits read as zero here.
_LOW_HALF_MASK = 0xFFFF

STRING_LENGTH_BYTES = _U64.size  # a string is a u64 byte length followed by UTF-8 bytes
VALUE_TYPE_BYTES = _U32.size
ARRAY_HEADER_BYTES = VALUE_TYPE_BYTES + _U64.size  # element type + element count
N_DIMS_BYTES = _U32.size
DIM_BYTES = _U64.size
TENSOR_TYPE_BYTES = _U32.size
TENSOR_OFFSET_BYTES = _U64.size
FIXED_HEADER_BYTES = len(MAGIC_BYTES) + _U32.size + 2 * _U64.size  # magic, version, tensor and kv counts

GGML_MAX_DIMS = 4  # ggml tensors have at most four dimensions
INT64_MAX = 2**63 - 1  # ggml stores dimensions and element counts as int64_t
# Nested arrays are legal GGUF, but nothing real nests deeply; a cap keeps the recursion bounded.
MAX_ARRAY_DEPTH = 8
# Sane bounds on what the bytes alone would allow. Every Python object made for an entry costs tens of times
# the few bytes a minimal entry takes on disk, so without them a 50 MB file of a million empty entries takes
# gigabytes and tens of seconds. Real files are far inside: some 50 metadata keys, a few thousand tensors
# (experts are stored merged), vocabularies of at most ~262k tokens and ~450k merges.
MAX_KV_COUNT = 1 << 16
MAX_TENSOR_COUNT = 1 << 16
MAX_STRING_ELEMENTS = 1 << 21  # per array of strings
MAX_ARRAY_ELEMENTS = 1 << 24  # per array of numbers (converted by one numpy call, so a larger bound)
NAME_SHOWN_CHARS = 80  # how much of a (possibly hostile) name goes into an error message

# Scalar value types: how struct unpacks one, and the numpy dtype that unpacks an array of them at once.
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<B"), np.dtype("<u1")),  # one byte; any non-zero byte is true
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
INTEGER_TYPES = frozenset(t for t, (_, dt) in _SCALARS.items() if dt.kind in "iu" and t != GGUFValueType.BOOL)
_VALUE_TYPES = {int(t): t for t in GGUFValueType}


def _min_value_bytes(vtype: GGUFValueType) -> int:
    """The fewest bytes one value of `vtype` can occupy: what an array's count is checked against."""
    if vtype == GGUFValueType.STRING:
        return STRING_LENGTH_BYTES
    if vtype == GGUFValueType.ARRAY:
        return ARRAY_HEADER_BYTES
    return _SCALARS[vtype][0].size


_MIN_VALUE_BYTES = min(_min_value_bytes(t) for t in GGUFValueType)
# The fewest bytes one metadata entry (key, type, value) and one tensor info can occupy.
MIN_KV_BYTES = STRING_LENGTH_BYTES + VALUE_TYPE_BYTES + _MIN_VALUE_BYTES
MIN_TENSOR_INFO_BYTES = STRING_LENGTH_BYTES + N_DIMS_BYTES + DIM_BYTES + TENSOR_TYPE_BYTES + TENSOR_OFFSET_BYTES


def shown(name: str) -> str:
    """`name` quoted for a one-line message: escapes (so a newline cannot split it) and a length cap."""
    if len(name) > NAME_SHOWN_CHARS:
        name = name[:NAME_SHOWN_CHARS] + "..."
    return repr(name)


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor info as the header states it, dims in ggml order (dims[0] is the row length)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # relative to the start of the data section


@dataclass(frozen=True, slots=True)
class Header:
    """Everything before the tensor data, checked for structure and converted to Python values."""

    version: int
    metadata: dict[str, Any]
    value_types: dict[str, GGUFValueType]  # the stored type of each metadata value (alignment needs it)
    # the declared element type of each top-level array value, so that a vocabulary stored as numbers is
    # refused by its declared type rather than by whatever its converted values happen to be
    element_types: dict[str, GGUFValueType]
    tensors: list[RawTensor]
    end: int  # byte just past the last tensor info: the data section starts at the next aligned byte


class _Cursor:
    """A read position in `buf` that refuses to read, allocate or loop past the bytes that exist."""

    __slots__ = ("buf", "name", "pos", "size")

    def __init__(self, buf: Any, size: int, name: str) -> None:
        self.buf = buf
        self.size = size
        self.name = name
        self.pos = 0

    def fail(self, message: str) -> NoReturn:
        raise GgufError(f"{self.name}: {message}")

    def need(self, n: int, what: str) -> None:
        """Fail unless `n` more bytes exist for `what`."""
        left = self.size - self.pos
        if n > left:
            self.fail(f"truncated: {what} needs {n:,} bytes at byte {self.pos:,} but the file has {self.size:,} bytes")

    def u32(self, what: str) -> int:
        self.need(_U32.size, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += _U32.size
        return v

    def u64(self, what: str) -> int:
        self.need(_U64.size, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += _U64.size
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        self.need(n, f"{what} ({n:,} bytes)")
        raw = self.buf[self.pos : self.pos + n]
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} at byte {start:,} is not valid UTF-8 ({e.reason} at byte {self.pos + e.start:,})")
        self.pos += n
        return s

    def value_type(self, what: str) -> GGUFValueType:
        at = self.pos
        raw = self.u32(f"value type of {what}")
        vtype = _VALUE_TYPES.get(raw)
        if vtype is None:
            self.fail(f"{what} has unknown value type {raw:,} at byte {at:,}")
        return vtype

    def peek_value_type(self, what: str) -> GGUFValueType:
        """The value type at the read position, without moving past it."""
        at = self.pos
        try:
            return self.value_type(what)
        finally:
            self.pos = at

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
        """One value of `vtype`, converted to Python (arrays to lists)."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            unpacker = scalar[0]
            self.need(unpacker.size, f"{what} ({vtype.name})")
            (v,) = unpacker.unpack_from(self.buf, self.pos)
            self.pos += unpacker.size
            return bool(v) if vtype == GGUFValueType.BOOL else v
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        return self.array(what, depth)

    def array(self, what: str, depth: int) -> list[Any]:
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.value_type(f"elements of {what}")
        at = self.pos
        count = self.u64(f"element count of {what}")
        least = _min_value_bytes(etype)
        # The check that makes a claimed 2^63 elements fail here instead of hanging or exhausting memory.
        if count > (self.size - self.pos) // least:
            self.fail(
                f"truncated: {what} claims {count:,} {etype.name} elements at byte {at:,}, "
                f"which need at least {count * least:,} bytes, but only {self.size - self.pos:,} remain"
            )
        scalar = _SCALARS.get(etype)
        bound = MAX_ARRAY_ELEMENTS if scalar is not None else MAX_STRING_ELEMENTS
        if count > bound:
            self.fail(f"{what} claims {count:,} {etype.name} elements at byte {at:,}; fuselane reads at most {bound:,}")
        if scalar is not None:
            # Converted in one numpy call: per-element unpacking would dominate the tokenizer's load time.
            dtype = scalar[1]
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return arr.astype(bool).tolist() if etype == GGUFValueType.BOOL else arr.tolist()
        if etype == GGUFValueType.STRING:
            return self._string_array(count, what)
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]

    def _string_array(self, count: int, what: str) -> list[str]:
        # The hot loop for a tokenizer's vocabulary and merges (~300k strings): locals, no method calls.
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + STRING_LENGTH_BYTES > size:
                self.pos = pos
                self.need(STRING_LENGTH_BYTES, f"length of {what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += STRING_LENGTH_BYTES
            if n > size - pos:
                self.pos = pos
                self.need(n, f"{what}[{i}] ({n:,} bytes)")
            try:
                append(buf[pos : pos + n].decode("utf-8"))
            except UnicodeDecodeError as e:
                self.fail(f"{what}[{i}] at byte {pos:,} is not valid UTF-8 ({e.reason})")
            pos += n
        self.pos = pos
        return out


def check_magic(buf: Any, size: int, name: str) -> None:
    """Fail unless the file starts with the GGUF magic (a file too short to hold it is not GGUF either)."""
    head = bytes(buf[: len(MAGIC_BYTES)])
    if head != MAGIC_BYTES[: len(head)] or size < len(MAGIC_BYTES):
        raise GgufError(f"{name}: not a GGUF file (it does not start with {MAGIC_BYTES.decode()!r})")


def scan_header(buf: Any, size: int, name: str) -> Header:
    """Read and check the header in `buf` (the first `size` bytes are the whole file).

    Raises GgufError with a one-line message naming `name` for anything malformed or hostile.
    """
    check_magic(buf, size, name)
    cur = _Cursor(buf, size, name)
    cur.pos = len(MAGIC_BYTES)
    version = cur.u32("version")
    if version not in READER_SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(_U32.size, "little"), "big")
        if version & _LOW_HALF_MASK == 0 and swapped in READER_SUPPORTED_VERSIONS:
            cur.fail("big-endian GGUF files are not supported; convert the file to little-endian")
        supported = " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        cur.fail(f"GGUF version {version:,} is not supported (fuselane reads versions {supported})")
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata count")
    left = size - cur.pos
    least = kv_count * MIN_KV_BYTES + tensor_count * MIN_TENSOR_INFO_BYTES
    if least > left:
        cur.fail(
            f"truncated: header claims {kv_count:,} metadata entries and {tensor_count:,} tensors, "
            f"which need at least {least:,} bytes, but only {left:,} remain"
        )
    for count, bound, what in (
        (kv_count, MAX_KV_COUNT, "metadata entries"),
        (tensor_count, MAX_TENSOR_COUNT, "tensors"),
    ):
        if count > bound:
            cur.fail(f"header claims {count:,} {what}; fuselane reads at most {bound:,}")
    metadata: dict[str, Any] = {}
    value_types: dict[str, GGUFValueType] = {}
    element_types: dict[str, GGUFValueType] = {}
    for i in range(kv_count):
        at = cur.pos
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            cur.fail(f"duplicate metadata key {shown(key)} at byte {at:,}")
        what = f"metadata {shown(key)}"
        vtype = cur.value_type(what)
        if vtype == GGUFValueType.ARRAY:
            element_types[key] = cur.peek_value_type(f"elements of {what}")
        metadata[key] = cur.value(vtype, what)
        value_types[key] = vtype
    tensors: list[RawTensor] = []
    seen: set[str] = set()
    for i in range(tensor_count):
        at = cur.pos
        t = _tensor_info(cur, i)
        if t.name in seen:
            cur.fail(f"duplicate tensor name {shown(t.name)} at byte {at:,}")
        seen.add(t.name)
        tensors.append(t)
    return Header(version, metadata, value_types, element_types, tensors, cur.pos)


def _tensor_info(cur: _Cursor, index: int) -> RawTensor:
    name = cur.string(f"name of tensor #{index}")
    what = f"tensor {shown(name)}"
    n_dims = cur.u32(f"dimension count of {what}")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        cur.fail(f"{what} has {n_dims:,} dimensions; GGUF tensors have 1 to {GGML_MAX_DIMS}")
    dims = tuple(cur.u64(f"dimension {d} of {what}") for d in range(n_dims))
    elements = 1
    for d in dims:
        if d < 1:
            cur.fail(f"{what} has a dimension of {d} in {list(dims)}; every dimension must be at least 1")
        elements *= d
    if elements > INT64_MAX:
        cur.fail(f"{what} has dimensions {list(dims)} whose element count overflows a 64-bit integer")
    type_id = cur.u32(f"type of {what}")
    offset = cur.u64(f"data offset of {what}")
    return RawTensor(name, dims, type_id, offset)
