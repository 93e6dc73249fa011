"""Open a GGUF checkpoint: validate it with a bounded scan, then expose metadata and memory-mapped tensors.

Why not `gguf.GGUFReader`: it trusts the counts and lengths a file claims, so a few dozen bytes declaring a
2^63-element array make it hang or exhaust memory, and a truncated or inconsistent file fails with whatever
exception numpy happens to raise. Validation therefore has to walk the whole header first, bounded by the
bytes actually present (`fuselane.gguf.scan`). Once that walk exists, handing the file to GGUFReader as well
only costs time: measured on the real Qwen2.5-Coder-0.5B Q4_K_M file (491 MB, 151,936 tokens, 151,387
merges), `GGUFReader(path)` alone takes about 6.7 s, because it builds a numpy view for every part of every
tokenizer string, while the scan, which converts the metadata to Python values as it goes, plus the tensor
placement below take about 0.12 s. So this module uses only the scan and one read-only memory map; the `gguf`
package remains the source of the format's constants (magic, value types, versions, default alignment, type
names), and the tests check the results against GGUFReader's.

What is checked here, after the scan: the stored type of every metadata key fuselane reads
(`fuselane.gguf.keys`), every tensor's type is a `Format` fuselane reads, its rows are whole
blocks, its offset is aligned, its data lies inside the file and does not overlap another tensor's, and
`general.alignment` is an integer power of two. Every failure is a `GgufError` whose one-line message names
the file and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, Keys

from fuselane.errors import GgufError
from fuselane.gguf.formats import LAYOUTS, Format, is_supported, tensor_bytes
from fuselane.gguf.keys import check_types
from fuselane.gguf.scan import INTEGER_TYPES, MAGIC_BYTES, Header, check_magic, scan_header, shown


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file: its format, numpy-order shape and where its bytes are.

    `shape` is in numpy order (the ggml dimensions reversed), so the last axis is the row length, e.g.
    token_embd.weight is (vocab, hidden). `data` is a read-only 1-D uint8 view into the file's memory map,
    not a copy; it is left out of comparisons and the repr.
    """

    name: str
    format: Format
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    data: np.ndarray = field(compare=False, repr=False)


@dataclass(slots=True)
class GgufFile:
    """An opened, validated GGUF file. Use as a context manager, or call `close()` when done."""

    path: Path
    version: int
    size: int  # real file size in bytes
    alignment: int
    # key -> str, int, float, bool, or a list of those (nested lists for nested arrays)
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order
    _mmap: mmap.mmap | None = field(default=None, repr=False, compare=False)

    def close(self) -> None:
        """Release the memory map; `tensors` is emptied, `metadata` stays usable.

        A tensor's `data` array that the caller still holds keeps the mapping alive (unmapping under a live
        array would turn later reads into a crash); the mapping then goes away when the last such array does.
        """
        mm, self._mmap = self._mmap, None
        self.tensors = {}
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # arrays held elsewhere still export the buffer; see the docstring

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """Open and validate the GGUF file at `path`, memory-mapping its tensor data.

    Raises GgufError (one line, naming the file) if the file is missing, unreadable, not GGUF, of an
    unsupported version, malformed, truncated, or holds a tensor fuselane cannot read. Time and memory are
    bounded by the file's real size, whatever counts and lengths it claims: tensor data stays in the map,
    and the metadata's Python objects take at most a small multiple (about 8x) of the bytes they came from.
    """
    p = Path(path)
    name = os.fspath(path)
    mm = _map(p, name)
    try:
        layout = check_layout(mm, len(mm), name)
    except BaseException:
        mm.close()  # no array views exist yet: they are made only once every check has passed
        raise
    tensors = layout.views(np.frombuffer(mm, dtype=np.uint8))
    return GgufFile(p, layout.header.version, layout.size, layout.alignment, layout.header.metadata, tensors, mm)


@dataclass(frozen=True, slots=True)
class Layout:
    """A whole GGUF file checked in memory: its header, alignment and every tensor's place in it."""

    header: Header
    size: int
    alignment: int
    placed: list[_Placed]

    def views(self, whole: np.ndarray) -> dict[str, TensorInfo]:
        """Each tensor as a `TensorInfo` whose data is a view into `whole` (the file's bytes), in file order."""
        return {
            t.name: TensorInfo(t.name, t.format, t.shape, t.offset, t.nbytes, whole[t.offset : t.end])
            for t in self.placed
        }


def check_layout(buf: Any, size: int, name: str) -> Layout:
    """Every check `open_gguf` makes, on a file already in memory: `buf` holds its `size` bytes.

    Raises a one-line GgufError naming `name`. This is the reader's whole trust boundary, so tests and the
    fuzz target (fuzz/gguf_reader.py) call it directly on bytes.
    """
    header = scan_header(buf, size, name)
    check_types(header, name)
    alignment = _alignment(header, name)
    return Layout(header, size, alignment, _place_tensors(header, alignment, size, name))


def _map(path: Path, name: str) -> mmap.mmap:
    """Map the whole file read-only, turning every way of not getting there into a GgufError."""
    try:
        st = path.stat()
        # Opening a FIFO or device could block forever or read an endless stream: only plain files are read.
        if stat.S_ISDIR(st.st_mode):
            raise GgufError(f"{name}: is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise GgufError(f"{name}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GgufError(f"{name}: empty file, not a GGUF file")
            # Check the magic before mapping so that a stray non-GGUF file gets the plainest message.
            check_magic(f.read(len(MAGIC_BYTES)), size, name)
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise GgufError(f"{name}: no such file") from None
    except PermissionError:
        raise GgufError(f"{name}: cannot read it (permission denied)") from None
    except OSError as e:  # includes mmap's own failures
        raise GgufError(f"{name}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:  # mmap of a file that shrank to nothing after the size check
        raise GgufError(f"{name}: cannot map it ({e})") from None


def _alignment(header: Header, name: str) -> int:
    """The data alignment: `general.alignment` if present (an integer power of two), else the default."""
    key = Keys.General.ALIGNMENT
    if key not in header.metadata:
        return GGUF_DEFAULT_ALIGNMENT
    vtype = header.value_types[key]
    if vtype not in INTEGER_TYPES:
        raise GgufError(f"{name}: {key} is a {vtype.name} value, not an integer")
    value = header.metadata[key]
    if value <= 0 or value & (value - 1):
        raise GgufError(f"{name}: {key} is {value:,}, not a power of two")
    return value


def _type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id:,}"


@dataclass(frozen=True, slots=True)
class _Placed:
    """A tensor that passed every check, before its view into the map is made."""

    name: str
    format: Format
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _place_tensors(header: Header, alignment: int, size: int, name: str) -> list[_Placed]:
    """Check each tensor's format, row blocks, alignment and extent against a file of `size` bytes."""
    data_start = -(-header.end // alignment) * alignment  # the data section starts at the next aligned byte
    placed: list[_Placed] = []
    for raw in header.tensors:
        what = f"tensor {shown(raw.name)}"
        if not is_supported(raw.type_id):
            raise GgufError(f"{name}: {what} has type {_type_name(raw.type_id)}, which fuselane does not read")
        fmt = Format(raw.type_id)
        block = LAYOUTS[fmt].values
        if raw.dims[0] % block:
            raise GgufError(
                f"{name}: {what} has rows of {raw.dims[0]:,} values, not whole {fmt.name} blocks of {block}"
            )
        if raw.offset % alignment:
            raise GgufError(f"{name}: {what} data offset {raw.offset:,} is not a multiple of the alignment {alignment}")
        shape = tuple(reversed(raw.dims))
        nbytes = tensor_bytes(fmt, shape)
        start = data_start + raw.offset
        end = start + nbytes
        if end > size:
            raise GgufError(f"{name}: truncated: {what} data ends at byte {end:,} but the file has {size:,} bytes")
        placed.append(_Placed(raw.name, fmt, shape, start, nbytes))
    _check_overlap(placed, name)
    return placed


def _check_overlap(placed: list[_Placed], name: str) -> None:
    by_start = sorted(placed, key=lambda t: t.offset)
    for prev, cur in zip(by_start, by_start[1:], strict=False):
        if cur.offset < prev.end:
            raise GgufError(
                f"{name}: tensors {shown(prev.name)} (bytes {prev.offset:,} to {prev.end:,}) "
                f"and {shown(cur.name)} (from byte {cur.offset:,}) overlap"
            )
