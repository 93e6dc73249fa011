"""The GGUF loader: real tiny files round-trip, hostile ones fail fast with one-line GgufErrors.

Valid files are written with `gguf.GGUFWriter`; hostile ones are built byte by byte with `struct`, since the
writer refuses to produce them. Every hostile open runs in a watchdog thread with tracemalloc on, so a
regression to trusting a claimed count fails the test (too slow, too much memory) instead of hanging it.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf.constants import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuselane.errors import GgufError
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.reader import GgufFile, TensorInfo, open_gguf
from tests.gguf.traced import peak_of, tracing  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.usefixtures("tracing")

GUARD_SECONDS = 1.0  # a hostile open takes microseconds; a second means it is looping on a claimed count
PEAK_BYTES = 4 * 2**20  # a hostile open may allocate a little, never in proportion to a claimed size
HUGE = 2**63
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
ALIGN = 32
MAGIC = struct.pack("<I", GGUF_MAGIC)
VT = GGUFValueType
QT = GGMLQuantizationType


# --- byte builders for hand-made files -------------------------------------------------------------------


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def arr(etype: int, items: list[bytes], count: int | None = None) -> bytes:
    return u32(etype) + u64(len(items) if count is None else count) + b"".join(items)


def tinfo(name: str | bytes, dims: tuple[int, ...], type_id: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return gstr(name) + u32(n) + b"".join(u64(d) for d in dims) + u32(type_id) + u64(offset)


def build(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    infos: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = ALIGN,
) -> bytes:
    """A GGUF file: header, metadata, tensor infos, padding to `alignment`, then `data`."""
    head = MAGIC + u32(version)
    head += u64(len(infos) if n_tensors is None else n_tensors) + u64(len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    if not data:
        return head
    return head + bytes(-len(head) % alignment) + data


def f32_tensor(name: str = "w", rows: int = 2, cols: int = 8, offset: int = 0) -> tuple[bytes, bytes]:
    """A tensor info for an F32 (rows, cols) tensor and its data."""
    return tinfo(name, (cols, rows), QT.F32, offset), np.arange(rows * cols, dtype="<f4").tobytes()


# --- the watchdog ----------------------------------------------------------------------------------------


def guarded(fn: Callable[[], Any], timeout: float = GUARD_SECONDS) -> tuple[Any, BaseException | None, int]:
    """Run `fn` in a thread under tracemalloc (on for the module: `traced.tracing`): (result, exception, peak
    bytes it held beyond what was live before).

    Fails the test if `fn` outlives `timeout` (the thread is left behind as a daemon).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test to judge
            box["error"] = e

    def run() -> threading.Thread:
        th = threading.Thread(target=target, daemon=True)
        th.start()
        th.join(timeout)
        return th

    th, peak = peak_of(run)
    assert not th.is_alive(), f"open did not finish within {timeout} s"
    return box.get("result"), box.get("error"), peak


def write(tmp_path: Path, content: bytes, name: str = "model.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(content)
    return p


def expect_error(tmp_path: Path, content: bytes, fragment: str) -> str:
    """Open `content`: a one-line GgufError naming the file and containing `fragment`, fast and small."""
    p = write(tmp_path, content)
    result, error, peak = guarded(lambda: open_gguf(p))
    if isinstance(result, GgufFile):
        result.close()
    assert isinstance(error, GgufError), f"expected GgufError, got {error!r} / {result!r}"
    msg = str(error)
    assert fragment in msg, msg
    assert msg.startswith(f"{p}: "), msg
    assert "\n" not in msg, msg
    assert peak < PEAK_BYTES, f"peak {peak:,} bytes"
    return msg


# --- valid files through GGUFWriter ----------------------------------------------------------------------

F32_DATA = np.arange(6, dtype=np.float32).reshape(2, 3)
F16_DATA = (np.arange(32, dtype=np.float16) / 4).reshape(4, 8)
Q8_BYTES = np.random.default_rng(0).integers(0, 256, (3, 2 * LAYOUTS[Format.Q8_0].nbytes), dtype=np.uint8)
Q4K_BYTES = np.random.default_rng(1).integers(0, 256, (2, LAYOUTS[Format.Q4_K].nbytes), dtype=np.uint8)
METADATA: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
    "t.u8": (200, VT.UINT8, None),
    "t.i8": (-5, VT.INT8, None),
    "t.u16": (60000, VT.UINT16, None),
    "t.i16": (-3000, VT.INT16, None),
    "t.u32": (4_000_000_000, VT.UINT32, None),
    "t.i32": (-2_000_000_000, VT.INT32, None),
    "t.f32": (0.5, VT.FLOAT32, None),
    "t.bool": (True, VT.BOOL, None),
    "t.str": ("héllo ✓\nline two", VT.STRING, None),
    "t.u64": (2**63 + 5, VT.UINT64, None),
    "t.i64": (-(2**62), VT.INT64, None),
    "t.f64": (3.25, VT.FLOAT64, None),
    "t.strs": (["a", "", "Ġhello", "日本"], VT.ARRAY, VT.STRING),
    "t.ints": ([1, -2, 3], VT.ARRAY, VT.INT32),
    "t.u8s": ([0, 255, 7], VT.ARRAY, VT.UINT8),
    "t.floats": ([0.5, -1.25], VT.ARRAY, VT.FLOAT32),
    "t.bools": ([True, False, True], VT.ARRAY, VT.BOOL),
    "t.nested": ([[1, 2], [3]], VT.ARRAY, VT.ARRAY),
}


def write_valid(path: Path, *, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, "tiny")
    for key, (value, vtype, sub) in METADATA.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_tensor("f32", F32_DATA)
    w.add_tensor("f16", F16_DATA)
    w.add_tensor("q8", Q8_BYTES, raw_dtype=QT.Q8_0)
    w.add_tensor("q4k", Q4K_BYTES, raw_dtype=QT.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def valid(tmp_path: Path) -> Path:
    return write_valid(tmp_path / "tiny.gguf")


def test_round_trip_metadata(valid: Path) -> None:
    with open_gguf(valid) as f:
        assert f.version == 3
        assert f.alignment == ALIGN
        assert f.size == valid.stat().st_size
        assert f.path == valid
        assert f.metadata["general.architecture"] == "tiny"
        for key, (value, _, _) in METADATA.items():
            got = f.metadata[key]
            assert got == value, key
            assert type(got) is type(value), key
        assert type(f.metadata["t.bools"][0]) is bool
        assert type(f.metadata["t.floats"][0]) is float
        assert not any(k.startswith("GGUF.") for k in f.metadata)


def test_round_trip_tensors(valid: Path) -> None:
    with open_gguf(valid) as f:
        assert list(f.tensors) == ["f32", "f16", "q8", "q4k"]
        t = f.tensors["f32"]
        assert (t.format, t.shape, t.nbytes) == (Format.F32, (2, 3), F32_DATA.nbytes)
        assert np.array_equal(t.data.view("<f4").reshape(t.shape), F32_DATA)
        t = f.tensors["f16"]
        assert (t.format, t.shape) == (Format.F16, (4, 8))
        assert np.array_equal(t.data.view("<f2").reshape(t.shape), F16_DATA)
        t = f.tensors["q8"]
        assert (t.format, t.shape, t.nbytes) == (Format.Q8_0, (3, 64), Q8_BYTES.nbytes)
        assert t.data.tobytes() == Q8_BYTES.tobytes()
        t = f.tensors["q4k"]
        assert (t.format, t.shape) == (Format.Q4_K, (2, 256))
        assert t.data.tobytes() == Q4K_BYTES.tobytes()
        raw = valid.read_bytes()
        for t in f.tensors.values():
            assert t.offset % ALIGN == 0
            assert raw[t.offset : t.offset + t.nbytes] == t.data.tobytes()


def test_tensor_data_is_a_read_only_view_of_the_map(valid: Path) -> None:
    with open_gguf(valid) as f:
        data = f.tensors["q8"].data
        assert data.dtype == np.uint8 and data.ndim == 1
        assert not data.flags.owndata and not data.flags.writeable
        base = data
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, memoryview):
            base = base.obj
        assert isinstance(base, mmap.mmap)


def test_matches_gguf_reader(valid: Path) -> None:
    ref = gguf.GGUFReader(valid)
    with open_gguf(valid) as f:
        assert len(f.tensors) == len(ref.tensors)
        for rt in ref.tensors:
            t = f.tensors[rt.name]
            assert t.shape == tuple(reversed(rt.shape.tolist()))
            assert t.offset == rt.data_offset
            assert t.nbytes == rt.n_bytes
            assert t.data.tobytes() == rt.data.tobytes()
        for key, field in ref.fields.items():
            if not key.startswith("GGUF.") and key != "t.nested":  # GGUFReader flattens nested arrays
                assert f.metadata[key] == field.contents(), key


def test_tensor_info_compares_without_data(valid: Path) -> None:
    with open_gguf(valid) as a, open_gguf(valid) as b:
        assert a.tensors["f32"] == b.tensors["f32"]
        assert hash(a.tensors["f32"]) == hash(b.tensors["f32"])
        assert "data" not in repr(a.tensors["f32"])
        assert isinstance(a.tensors["f32"], TensorInfo)


def test_close_releases_and_is_idempotent(valid: Path) -> None:
    f = open_gguf(valid)
    kept = f.tensors["f32"].data  # a caller's array keeps the mapping alive: reading it must stay safe
    f.close()
    f.close()
    assert f.tensors == {}
    assert f.metadata["t.u8"] == 200
    assert kept.view("<f4")[5] == 5.0
    g = open_gguf(valid)
    mm = g._mmap
    g.close()
    assert mm is not None and mm.closed


def test_custom_alignment(tmp_path: Path) -> None:
    p = write_valid(tmp_path / "a64.gguf", alignment=64)
    with open_gguf(p) as f:
        assert f.alignment == 64
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        assert np.array_equal(f.tensors["f32"].data.view("<f4").reshape(2, 3), F32_DATA)


def test_version_2_and_hand_built(tmp_path: Path) -> None:
    info, data = f32_tensor()
    empty_array = kv("e", VT.ARRAY, arr(VT.INT32, []))
    p = write(tmp_path, build([empty_array, kv("k", VT.STRING, gstr(""))], [info], data, version=2))
    with open_gguf(p) as f:
        assert f.version == 2
        assert f.metadata == {"e": [], "k": ""}
        assert f.tensors["w"].shape == (2, 8)


@pytest.mark.parametrize("etype", [VT.UINT8, VT.BOOL, VT.STRING, VT.ARRAY])
def test_empty_array_at_end_of_file(tmp_path: Path, etype: GGUFValueType) -> None:
    with open_gguf(write(tmp_path, build([kv("e", VT.ARRAY, arr(etype, []))]))) as f:
        assert f.metadata == {"e": []}


def test_no_tensors(tmp_path: Path) -> None:
    with open_gguf(write(tmp_path, build([kv("k", VT.UINT8, b"\x01")]))) as f:
        assert f.tensors == {} and f.metadata == {"k": 1}


def test_every_truncation_fails_cleanly(tmp_path: Path, valid: Path) -> None:
    """Cut the file at every byte: a GgufError each time, until only trailing padding is missing."""
    content = valid.read_bytes()
    with open_gguf(valid) as f:
        data_end = max(t.offset + t.nbytes for t in f.tensors.values())
    p = write(tmp_path, content, "cut.gguf")

    def every_cut() -> dict[int, tuple[type, str] | None]:
        # Shrinking one file in place: rewriting it per cut costs milliseconds each on some filesystems.
        outcomes: dict[int, tuple[type, str] | None] = {}
        for cut in reversed(range(len(content))):
            os.truncate(p, cut)
            try:
                open_gguf(p).close()
                outcomes[cut] = None
            except Exception as e:  # noqa: BLE001 - judged below; kept as text so no traceback is held
                outcomes[cut] = (type(e), str(e))
        return outcomes

    # one open a cut, each far below GUARD_SECONDS: the bound grows with the cuts, so a loaded machine (tracemalloc
    # slows every allocation) does not fail it, while an open that loops still would
    per_cut = GUARD_SECONDS / 50
    outcomes, error, peak = guarded(every_cut, timeout=max(GUARD_SECONDS * 5, per_cut * len(content)))
    assert error is None, repr(error)
    assert peak < PEAK_BYTES
    for cut, outcome in sorted(outcomes.items()):
        if cut < data_end:
            assert outcome is not None and outcome[0] is GgufError, f"cut at {cut}: {outcome!r}"
            assert "\n" not in outcome[1]
        else:  # only the padding after the last tensor is gone: still a whole file
            assert outcome is None, f"cut at {cut}: {outcome!r}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=8))
def test_random_corruption_loads_or_raises_gguf_error(valid: Path, edits: list[tuple[int, int]]) -> None:
    content = bytearray(valid.read_bytes())
    for pos, byte in edits:
        content[pos % len(content)] = byte
    with tempfile.TemporaryDirectory() as d:
        p = write(Path(d), bytes(content))
        result, error, _ = guarded(lambda: open_gguf(p))
        assert error is None or isinstance(error, GgufError), repr(error)
        if result is not None:
            result.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_header_loads_or_raises_gguf_error(body: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = write(Path(d), MAGIC + u32(3) + body)
        result, error, _ = guarded(lambda: open_gguf(p))
        assert error is None or isinstance(error, GgufError), repr(error)
        if result is not None:
            result.close()


# --- files that are not GGUF or cannot be read -----------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="is a directory"):
        open_gguf(tmp_path)


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    _, error, _ = guarded(lambda: open_gguf(fifo))  # opening a FIFO for reading would block
    assert isinstance(error, GgufError) and "not a regular file" in str(error)


def test_unreadable(tmp_path: Path, valid: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root reads a chmod-000 file anyway, so the refusal is simulated where the reader opens the file.
    def refuse(*_: object, **__: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("fuselane.gguf.reader.open", refuse, raising=False)
    with pytest.raises(GgufError, match=r"cannot read it \(permission denied\)"):
        open_gguf(valid)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "empty file"),
        (b"GG", "not a GGUF file"),
        (b"PK\x03\x04" + bytes(60), "not a GGUF file"),
        (b'{\n  "json": true}', "not a GGUF file"),
        (MAGIC + u32(1) + bytes(16), "GGUF version 1 is not supported (fuselane reads versions 2 and 3)"),
        (MAGIC + u32(4) + bytes(16), "GGUF version 4 is not supported"),
        (MAGIC + struct.pack(">I", 3) + bytes(16), "big-endian GGUF files are not supported"),
        (MAGIC + u32(3) + bytes(3), "truncated: tensor count needs 8 bytes"),
    ],
)
def test_not_gguf(tmp_path: Path, content: bytes, fragment: str) -> None:
    expect_error(tmp_path, content, fragment)


# --- the real checkpoint ---------------------------------------------------------------------------------


@pytest.mark.real
def test_real_file(qwen_gguf: str) -> None:
    start = time.perf_counter()
    f = open_gguf(qwen_gguf)
    elapsed = time.perf_counter() - start
    print(f"\nopen_gguf({Path(qwen_gguf).name}): {elapsed:.3f} s for {f.size:,} bytes")
    with f:
        md = f.metadata
        assert md["general.architecture"] == "qwen2"
        assert len(f.tensors) == 291
        assert len(md["tokenizer.ggml.tokens"]) == 151936
        assert isinstance(md["tokenizer.ggml.tokens"][0], str)
        assert len(md["tokenizer.ggml.token_type"]) == 151936
        assert all(type(v) is int for v in md["tokenizer.ggml.token_type"][:100])
        assert len(md["tokenizer.ggml.merges"]) == 151387
        assert f.tensors["token_embd.weight"].shape == (151936, 896)
        ref = gguf.GGUFReader(qwen_gguf)
        assert [t.name for t in ref.tensors] == list(f.tensors)
        for rt in ref.tensors:
            t = f.tensors[rt.name]
            assert t.shape == tuple(reversed(rt.shape.tolist())), rt.name
            assert int(t.format) == int(rt.tensor_type), rt.name
            assert (t.offset, t.nbytes) == (rt.data_offset, rt.n_bytes), rt.name
        for key in (
            "general.name",
            "qwen2.block_count",
            "qwen2.rope.freq_base",
            "tokenizer.ggml.eos_token_id",
        ):
            assert md[key] == ref.fields[key].contents(), key
        first, last = ref.tensors[0], ref.tensors[-1]
        assert f.tensors[first.name].data[:64].tobytes() == first.data.reshape(-1).view(np.uint8)[:64].tobytes()
        assert f.tensors[last.name].data[-64:].tobytes() == last.data.reshape(-1).view(np.uint8)[-64:].tobytes()
