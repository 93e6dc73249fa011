"""The GGUF loader on hostile files built byte by byte: claimed counts and lengths past what the file holds,
malformed values, and tensor layouts that do not fit. Each opens in `test_reader`'s watchdog (a one-line
GgufError, fast, its memory bounded by the file's real size, never by a count it claims).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from fuselane.gguf.reader import open_gguf
from fuselane.gguf.scan import GGML_MAX_DIMS, MAX_ARRAY_DEPTH
from tests.gguf.test_reader import (
    ALIGN,
    HUGE,
    QT,
    U32_MAX,
    U64_MAX,
    VT,
    arr,
    build,
    expect_error,
    f32_tensor,
    gstr,
    kv,
    tinfo,
    u32,
    u64,
    write,
)
from tests.gguf.traced import peak_of, tracing  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.usefixtures("tracing")


# --- hostile counts and lengths --------------------------------------------------------------------------


def test_huge_array_count(tmp_path: Path) -> None:
    content = build([kv("a", VT.ARRAY, arr(VT.UINT64, [], count=HUGE))])
    expect_error(tmp_path, content, "metadata 'a' claims 9,223,372,036,854,775,808 UINT64 elements")


def test_huge_string_array_count(tmp_path: Path) -> None:
    content = build([kv("a", VT.ARRAY, arr(VT.STRING, [gstr("x")], count=HUGE))])
    expect_error(tmp_path, content, "claims 9,223,372,036,854,775,808 STRING elements")


def test_huge_nested_array_count(tmp_path: Path) -> None:
    content = build([kv("a", VT.ARRAY, arr(VT.ARRAY, [arr(VT.UINT8, [], count=HUGE)]))])
    expect_error(tmp_path, content, "metadata 'a'[0] claims 9,223,372,036,854,775,808 UINT8 elements")


def test_huge_string_length_value(tmp_path: Path) -> None:
    content = build([kv("s", VT.STRING, u64(HUGE) + b"abc")])
    expect_error(tmp_path, content, "truncated: metadata 's' (9,223,372,036,854,775,808 bytes) needs")


def test_huge_string_length_key(tmp_path: Path) -> None:
    content = build([u64(HUGE) + b"key" + u32(VT.UINT8) + b"\x00"])
    expect_error(tmp_path, content, "truncated: metadata key #0 (9,223,372,036,854,775,808 bytes) needs")


def test_huge_string_length_in_string_array(tmp_path: Path) -> None:
    content = build([kv("a", VT.ARRAY, arr(VT.STRING, [gstr("ok"), u64(HUGE) + b"xy"]))])
    expect_error(tmp_path, content, "metadata 'a'[1] (9,223,372,036,854,775,808 bytes)")


def test_huge_tensor_name_length(tmp_path: Path) -> None:
    content = build([], [u64(HUGE) + b"w" + bytes(40)])
    expect_error(tmp_path, content, "name of tensor #0 (9,223,372,036,854,775,808 bytes)")


def test_max_kv_count(tmp_path: Path) -> None:
    content = build([kv("k", VT.UINT8, b"\x01")], n_kv=U64_MAX)
    expect_error(tmp_path, content, "claims 18,446,744,073,709,551,615 metadata entries")


def test_huge_tensor_count(tmp_path: Path) -> None:
    info, data = f32_tensor()
    content = build([], [info], data, n_tensors=HUGE)
    expect_error(tmp_path, content, "9,223,372,036,854,775,808 tensors")


def test_kv_count_just_too_big(tmp_path: Path) -> None:
    # plausible by the minimal-size bound, so the loop starts, then runs out of bytes in the second entry
    content = build([kv("k", VT.UINT8, b"\x01"), bytes(12)])
    expect_error(tmp_path, content, "truncated: metadata '' (UINT8) needs 1 bytes at byte 50")


def test_n_dims_max(tmp_path: Path) -> None:
    content = build([], [tinfo("w", (8, 2), QT.F32, 0, n_dims=U32_MAX)])
    expect_error(tmp_path, content, f"tensor 'w' has 4,294,967,295 dimensions; GGUF tensors have 1 to {GGML_MAX_DIMS}")


def test_n_dims_five(tmp_path: Path) -> None:
    content = build([], [tinfo("w", (1, 1, 1, 1, 1), QT.F32, 0)])
    expect_error(tmp_path, content, "tensor 'w' has 5 dimensions")


def test_n_dims_zero(tmp_path: Path) -> None:
    content = build([], [tinfo("w", (), QT.F32, 0)]) + bytes(ALIGN)
    expect_error(tmp_path, content, "tensor 'w' has 0 dimensions")


def test_zero_dim(tmp_path: Path) -> None:
    content = build([], [tinfo("w", (8, 0), QT.F32, 0)])
    expect_error(tmp_path, content, "tensor 'w' has a dimension of 0 in [8, 0]; every dimension must be at least 1")


def test_dims_product_overflows(tmp_path: Path) -> None:
    content = build([], [tinfo("w", (2**32, 2**32, 2**32, 2**32), QT.F32, 0)])
    expect_error(tmp_path, content, "whose element count overflows a 64-bit integer")


def test_single_dim_overflows(tmp_path: Path) -> None:
    content = build([], [tinfo("w", (U64_MAX,), QT.F32, 0)])
    expect_error(tmp_path, content, "overflows a 64-bit integer")


def test_huge_but_legal_dims_are_checked_against_the_file(tmp_path: Path) -> None:
    info, data = f32_tensor()
    content = build([], [tinfo("w", (2**31, 2**31), QT.F32, 0)], data)
    expect_error(tmp_path, content, "truncated: tensor 'w' data ends at byte 18,446,744,073,709,551,")


def test_deep_nesting(tmp_path: Path) -> None:
    value = arr(VT.UINT8, [b"\x01"])
    for _ in range(MAX_ARRAY_DEPTH):
        value = arr(VT.ARRAY, [value])
    expect_error(tmp_path, build([kv("deep", VT.ARRAY, value)]), f"nests arrays more than {MAX_ARRAY_DEPTH} deep")


def test_nesting_at_the_limit_loads(tmp_path: Path) -> None:
    value = arr(VT.UINT8, [b"\x01"])
    expected: Any = [1]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        value, expected = arr(VT.ARRAY, [value]), [expected]
    with open_gguf(write(tmp_path, build([kv("deep", VT.ARRAY, value)]))) as f:
        assert f.metadata["deep"] == expected


# --- malformed values ------------------------------------------------------------------------------------


def test_unknown_value_type(tmp_path: Path) -> None:
    expect_error(tmp_path, build([kv("k", 13, b"\x00" * 8)]), "metadata 'k' has unknown value type 13")


def test_unknown_array_element_type(tmp_path: Path) -> None:
    content = build([kv("k", VT.ARRAY, u32(99) + u64(1) + bytes(8))])
    expect_error(tmp_path, content, "elements of metadata 'k' has unknown value type 99")


def test_non_utf8_key(tmp_path: Path) -> None:
    expect_error(tmp_path, build([kv(b"k\xff", VT.UINT8, b"\x00")]), "metadata key #0 at byte 24 is not valid UTF-8")


def test_non_utf8_value(tmp_path: Path) -> None:
    expect_error(tmp_path, build([kv("k", VT.STRING, gstr(b"\xc3("))]), "metadata 'k' at byte")


def test_non_utf8_string_array_element(tmp_path: Path) -> None:
    content = build([kv("toks", VT.ARRAY, arr(VT.STRING, [gstr("a"), gstr(b"\x80")]))])
    expect_error(tmp_path, content, "metadata 'toks'[1] at byte")


def test_non_utf8_tensor_name(tmp_path: Path) -> None:
    msg = expect_error(tmp_path, build([], [tinfo(b"\xfe", (8,), QT.F32, 0)]), "name of tensor #0 at byte")
    assert "not valid UTF-8" in msg


def test_duplicate_key(tmp_path: Path) -> None:
    content = build([kv("k", VT.UINT8, b"\x01"), kv("k", VT.UINT8, b"\x02")])
    expect_error(tmp_path, content, "duplicate metadata key 'k'")


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    info, data = f32_tensor()
    expect_error(tmp_path, build([], [info, info], data), "duplicate tensor name 'w'")


def test_hostile_name_stays_on_one_line(tmp_path: Path) -> None:
    name = "evil\nname" + "x" * 500
    msg = expect_error(tmp_path, build([kv(name, 77, b"")]), "'evil\\nname")
    assert len(msg) < len(name)


# --- tensor layout ---------------------------------------------------------------------------------------


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    # Q8_K: llama.cpp's activation format inside its CPU kernels, never a file's weights
    content = build([], [tinfo("x", (256,), QT.Q8_K, 0)], bytes(292))
    expect_error(tmp_path, content, "tensor 'x' has type Q8_K, which fuselane does not read")


def test_unknown_tensor_type(tmp_path: Path) -> None:
    content = build([], [tinfo("x", (32,), 999, 0)], bytes(64))
    expect_error(tmp_path, content, "tensor 'x' has type unknown type 999, which fuselane does not read")


def test_row_not_whole_blocks(tmp_path: Path) -> None:
    content = build([], [tinfo("q", (100, 2), QT.Q4_K, 0)], bytes(4096))
    expect_error(tmp_path, content, "tensor 'q' has rows of 100 values, not whole Q4_K blocks of 256")


def test_misaligned_offset(tmp_path: Path) -> None:
    info, data = f32_tensor(offset=4)
    content = build([], [info], data + bytes(ALIGN))
    expect_error(tmp_path, content, "tensor 'w' data offset 4 is not a multiple of the alignment 32")


def test_data_past_end(tmp_path: Path) -> None:
    info, data = f32_tensor(rows=4)
    content = build([], [info], data[:-1])
    msg = expect_error(tmp_path, content, "truncated: tensor 'w' data ends at byte ")
    assert msg.endswith(f"but the file has {len(content):,} bytes")


def test_offset_past_end(tmp_path: Path) -> None:
    info, data = f32_tensor(offset=HUGE)
    expect_error(tmp_path, build([], [info], data), "truncated: tensor 'w' data ends at byte 9,223,372,036,854,")


def test_overlapping_tensors(tmp_path: Path) -> None:
    a, data = f32_tensor("a", rows=2, cols=8)  # 64 bytes
    b, _ = f32_tensor("b", rows=1, cols=8, offset=ALIGN)
    expect_error(tmp_path, build([], [a, b], data), "tensors 'a' (bytes ")


def test_shared_offset_overlaps(tmp_path: Path) -> None:
    a, data = f32_tensor("a")
    b, _ = f32_tensor("b")
    msg = expect_error(tmp_path, build([], [a, b], data), "overlap")
    assert "'a'" in msg and "'b'" in msg


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        (kv("general.alignment", VT.UINT32, u32(48)), "general.alignment is 48, not a power of two"),
        (kv("general.alignment", VT.UINT32, u32(0)), "general.alignment is 0, not a power of two"),
        (
            kv("general.alignment", VT.INT32, struct.pack("<i", -32)),
            "general.alignment is -32, not a power of two",
        ),
        (kv("general.alignment", VT.FLOAT32, struct.pack("<f", 32.0)), "FLOAT32 value, not an integer"),
        (kv("general.alignment", VT.STRING, gstr("32")), "STRING value, not an integer"),
        (kv("general.alignment", VT.BOOL, b"\x01"), "BOOL value, not an integer"),
    ],
)
def test_bad_alignment(tmp_path: Path, entry: bytes, fragment: str) -> None:
    info, data = f32_tensor()
    expect_error(tmp_path, build([entry], [info], data), fragment)


def test_hand_built_alignment_is_used(tmp_path: Path) -> None:
    info, data = f32_tensor(offset=16)
    content = build([kv("general.alignment", VT.UINT32, u32(16))], [info], bytes(16) + data, alignment=16)
    with open_gguf(write(tmp_path, content)) as f:
        assert f.alignment == 16
        t = f.tensors["w"]
        assert t.offset % 16 == 0 and t.data.tobytes() == data
