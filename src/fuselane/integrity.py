"""Whether a cached model is still the file that was verified when it was pulled, checked cheaply on every open.

A pull checks the whole file's sha256 against the published one, then stores a record beside the file: its size,
that sha256, and a fingerprint (the file's mtime in nanoseconds and the sha256 of a few blocks sampled across
it). Opening the model compares the size and the fingerprint with the record, which costs a stat and a few
reads; only where they disagree (the file was written to, copied, touched, or the record is missing) is the
whole sha256 computed again. A file whose sha256 is not the published one is refused, never run: corrupted
weights of the right size would otherwise print garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from fuselane.errors import FuselaneError

SAMPLE_BLOCKS = 16  # blocks read for the fingerprint, spread evenly from the first byte to the last
SAMPLE_BYTES = 64 << 10  # bytes of each sampled block
RECORD_SUFFIX = ".verified.json"


@dataclass(frozen=True, slots=True)
class Record:
    """What a verified file was: size, whole-file sha256, and the cheap fingerprint of that state."""

    size: int
    sha256: str
    mtime_ns: int
    sample: str


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def sha256_file(path: Path) -> str:
    """The whole file's sha256, read through one reused buffer (memory stays at the buffer)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _sample(path: Path, size: int) -> str:
    """The sha256 of SAMPLE_BLOCKS blocks spread over the file (the whole file when it is that small)."""
    digest = hashlib.sha256()
    last = max(size - SAMPLE_BYTES, 0)
    offsets = sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)})
    with path.open("rb") as f:
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def fingerprint(path: Path, sha256: str) -> Record:
    """The record of `path` as it is now, for a file whose whole sha256 is `sha256`."""
    st = path.stat()
    return Record(st.st_size, sha256, st.st_mtime_ns, _sample(path, st.st_size))


def write_record(path: Path, sha256: str) -> None:
    """Store the record of a file just verified to have `sha256` (written whole, then renamed into place)."""
    target = record_path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(asdict(fingerprint(path, sha256))) + "\n")
    os.replace(partial, target)


def read_record(path: Path) -> Record | None:
    """The stored record, or None where there is none or it cannot be read as one."""
    try:
        data = json.loads(record_path(path).read_text())
        return Record(int(data["size"]), str(data["sha256"]), int(data["mtime_ns"]), str(data["sample"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None  # a damaged record only costs a full hash


def verify(path: Path, size: int, sha256: str, name: str) -> None:
    """Refuse `path` unless it is the `size`-byte file of `sha256`: cheap where the record agrees, the whole
    sha256 where it does not (then the record is renewed, so the next open is cheap again)."""
    actual_size = path.stat().st_size
    if actual_size != size:
        raise FuselaneError(
            f"{path}: the cached {name} is {actual_size:,} bytes, not {size:,}: it is damaged; "
            f"run 'fuselane pull {name} --force' to fetch it again"
        )
    record = read_record(path)
    if record is not None and record.sha256 == sha256 and record == fingerprint(path, sha256):
        return
    actual = sha256_file(path)
    if actual != sha256:
        raise FuselaneError(
            f"{path}: the cached {name} has sha256 {actual}, not the published {sha256}: it is corrupted; "
            f"run 'fuselane pull {name} --force' to fetch it again"
        )
    try:
        write_record(path, sha256)
    except OSError:
        pass  # a read-only cache: the file is sound, and the next open hashes it again


def remove_record(path: Path) -> None:
    record_path(path).unlink(missing_ok=True)


__all__ = ["Record", "read_record", "record_path", "remove_record", "sha256_file", "verify", "write_record"]
