"""Property: a valid file with hostile numbers written into its header is refused by name, fast, or read.

The fuzz target (fuzz/gguf_reader.py) searches blindly; this test aims. Every place in a real header where a
count or a length is stored holds a small u64, so the mutations overwrite such places with the values that
break readers which believe them (0, 2^31, 2^32 - 1, 2^63, 2^64 - 1, the file's size plus one, ...), and cut
the file short. Whatever the result, each stage of loading (`fuzz.stages.read_like_fuselane`) must either
work or raise a `FuselaneError`, within a second and without allocating in proportion to a claimed size.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuselane.gguf.scan import scan_header
from fuzz.stages import read_like_fuselane
from tests.gguf.traced import peak_of, tracing  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.usefixtures("tracing")

SEED = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "gguf_reader" / "micro-qwen3-f16.bin"
U64 = struct.Struct("<Q")
SMALL = 1 << 20  # a stored u64 below this is a count, a length, a dimension or an offset (or data that looks so)
SECONDS = 1.0  # loading a 10 KB file takes milliseconds; a second means a loop on a claimed count
PEAK_BYTES = 64 << 20  # Python allocations for a 10 KB file; a believed 2^31 count would be gigabytes

BASE = SEED.read_bytes()
HEADER_END = scan_header(BASE, len(BASE), "seed").end
COUNT_OFFSETS = [i for i in range(HEADER_END - U64.size + 1) if 0 < U64.unpack_from(BASE, i)[0] < SMALL]
HOSTILE = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, len(BASE) + 1, len(BASE) * 8)


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(BASE)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(COUNT_OFFSETS))
        value = draw(st.sampled_from(HOSTILE) | st.integers(0, 2**64 - 1))
        U64.pack_into(data, at, value)
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


@given(mutated())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hostile_numbers_in_a_header_are_refused_or_read(data):
    started = time.perf_counter()
    outcome, peak = peak_of(lambda: read_like_fuselane(data))  # anything but a FuselaneError fails the test
    seconds = time.perf_counter() - started
    assert set(outcome.values()) <= {"ok", "refused"}
    assert seconds < SECONDS, f"{seconds:.2f} s for {outcome}"
    assert peak < PEAK_BYTES, f"{peak:,} bytes for {outcome}"


def test_the_seed_itself_loads_and_holds_counts():
    assert set(read_like_fuselane(BASE).values()) == {"ok"}
    assert len(COUNT_OFFSETS) > 100  # strings, arrays, dims and offsets of a whole model
