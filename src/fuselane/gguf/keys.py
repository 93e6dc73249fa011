"""The declared types of the metadata keys fuselane reads, checked once when a file is opened.

GGUF stores every metadata value with its type, and a converter bug or a hostile file can store any key with
any type: a vocabulary as INT32, token types as STRING, a chat template as an array. Code further on would
then fail with whatever Python raises on the wrong kind of value (a `TypeError` from `len(5)`), or worse,
load something meaningless (`list(map(int, ["1", "2"]))` accepts strings of digits). So the reader checks
the declared type of every key it knows before anything uses the value, and refuses a mismatch with one
line naming the key, the type expected and the type found.

Only the keys that hold for every architecture live here (general.*, tokenizer.*); the hyper-parameters
under an architecture's prefix are checked by `fuselane.models.config`, which knows which ones it reads.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from gguf.constants import GGUFValueType, Keys

from fuselane.errors import GgufError
from fuselane.gguf.scan import INTEGER_TYPES, Header, shown

_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})


class Kind(enum.Enum):
    """What a key must hold: a scalar of one family, or an array whose elements are of one family."""

    STRING = "STRING"
    INTEGER = "an integer type"
    BOOL = "BOOL"
    STRINGS = "ARRAY of STRING"
    INTEGERS = "ARRAY of an integer type"
    FLOATS = "ARRAY of a float type"


# For each kind: whether it is an array, and the stored types (of the value, or of its elements) accepted.
_ACCEPTED: dict[Kind, tuple[bool, frozenset[GGUFValueType]]] = {
    Kind.STRING: (False, frozenset({GGUFValueType.STRING})),
    Kind.INTEGER: (False, INTEGER_TYPES),
    Kind.BOOL: (False, frozenset({GGUFValueType.BOOL})),
    Kind.STRINGS: (True, frozenset({GGUFValueType.STRING})),
    Kind.INTEGERS: (True, INTEGER_TYPES),
    Kind.FLOATS: (True, _FLOAT_TYPES),
}

_TOKEN_ID_KEYS = (
    Keys.Tokenizer.BOS_ID,
    Keys.Tokenizer.EOS_ID,
    Keys.Tokenizer.EOT_ID,
    Keys.Tokenizer.EOM_ID,
    Keys.Tokenizer.UNK_ID,
    Keys.Tokenizer.SEP_ID,
    Keys.Tokenizer.PAD_ID,
    Keys.Tokenizer.MASK_ID,
)

# Every architecture-independent key that fuselane (info, the tokenizer, the chat template, the loader) reads.
EXPECTED: Mapping[str, Kind] = {
    Keys.General.ARCHITECTURE: Kind.STRING,
    Keys.General.NAME: Kind.STRING,
    Keys.General.FILE_TYPE: Kind.INTEGER,
    Keys.Tokenizer.MODEL: Kind.STRING,
    Keys.Tokenizer.PRE: Kind.STRING,
    Keys.Tokenizer.LIST: Kind.STRINGS,
    Keys.Tokenizer.MERGES: Kind.STRINGS,
    Keys.Tokenizer.TOKEN_TYPE: Kind.INTEGERS,
    Keys.Tokenizer.SCORES: Kind.FLOATS,
    Keys.Tokenizer.ADD_BOS: Kind.BOOL,
    Keys.Tokenizer.ADD_EOS: Kind.BOOL,
    Keys.Tokenizer.CHAT_TEMPLATE: Kind.STRING,
    **dict.fromkeys(_TOKEN_ID_KEYS, Kind.INTEGER),
}


def stored_type(header: Header, key: str) -> str:
    """How `key` is stored, as a message names it: `INT32`, or `ARRAY of INT32`."""
    vtype = header.value_types[key]
    if vtype == GGUFValueType.ARRAY:
        return f"ARRAY of {header.element_types[key].name}"
    return vtype.name


def check_types(header: Header, name: str) -> None:
    """Raise a GgufError naming the first known key whose stored type is not the one fuselane reads."""
    for key, kind in EXPECTED.items():
        vtype = header.value_types.get(key)
        if vtype is None:
            continue
        is_array, accepted = _ACCEPTED[kind]
        found = header.element_types[key] if vtype == GGUFValueType.ARRAY else vtype
        if (vtype == GGUFValueType.ARRAY) != is_array or found not in accepted:
            raise GgufError(
                f"{name}: metadata {shown(key)} is stored as {stored_type(header, key)}; expected {kind.value}"
            )
