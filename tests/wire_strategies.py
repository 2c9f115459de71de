"""Hypothesis strategies for wire messages, built from the msgspec types in schemas/.

``valid(T)`` draws JSON documents that decode as ``T`` (a Struct or a tagged union),
walking ``msgspec.inspect.type_info`` so every bound the type declares (patterns,
lengths, ranges, literals, tags) is honoured and a new field is fuzzed the day it is
added. ``message(T)`` mixes them with the bad kinds the services must refuse: near-valid
documents (one field of the wrong type, a required field missing, an extra field, an
unknown tag, out-of-range numbers, NaN and infinities, huge or hostile strings), garbage
bytes (invalid JSON, invalid UTF-8, deep nesting) and oversized bodies.

Every strategy yields ``bytes``, as a publisher would send them; the test decides what
each one should get by decoding it with the service's own type (``decodes``).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

Json = Any
"""A JSON document as Python builtins (what ``json.dumps`` takes)."""

Overrides = Mapping[str, st.SearchStrategy[Json]]
"""Field name (``"target"``) or ``"Struct.field"`` -> the strategy drawing its value:
keeps generated commands on the fuzz target, job URLs under a target's base URL, ..."""

HOSTILE_TEXT: tuple[str, ...] = (
    "",
    "\x00",
    "a\x00b",
    "\r\nX-Injected: 1",
    "\x1b[31mred\x1b[0m",
    "\u202egnp.exe",  # right-to-left override
    "\u200f\u200e\u2066",  # RTL/LTR marks and isolates
    "\ufeff",
    "\ud800",  # a lone surrogate (json.dumps writes it as an escape)
    "../../../../etc/passwd",
    "..\\..\\windows\\system32",
    "/",
    "*",
    ">",
    "a.*.b",
    "jf.>",
    "$JS.API.STREAM.DELETE.JF_WORK",
    "_INBOX.>",
    "a..b",
    ".",
    " ",
    "%00%2e%2e",
    "${jndi:ldap://127.0.0.1/x}",
    "'; DROP TABLE jobs; --",
    "<script>alert(1)</script>",
    "\u0000" * 64,
    "é" * 300,
    "\U0001d54f" * 300,  # astral-plane letters
    "a" * 4096,  # a very long token
)
"""Strings that have broken parsers, logs, subjects, KV keys and paths elsewhere."""

_CONTROL_ALPHABET = st.characters(codec="utf-8", categories=("Cc", "Cf", "Zl", "Zp", "Zs", "L"))


def hostile_text() -> st.SearchStrategy[str]:
    """Hostile strings: the known list, and text drawn from control and format characters."""
    return st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(_CONTROL_ALPHABET, max_size=64))


def _json_scalars() -> st.SearchStrategy[Json]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        hostile_text(),
    )


def any_json() -> st.SearchStrategy[Json]:
    """Any JSON value (NaN and infinities included, written as ``json.dumps`` does)."""
    return st.recursive(
        _json_scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


# --- valid documents, from the types ------------------------------------------------


def _pattern_text(pattern: str, min_len: int, max_len: int | None) -> st.SearchStrategy[str]:
    text = st.from_regex(pattern, fullmatch=True)
    return text.filter(lambda s: min_len <= len(s) and (max_len is None or len(s) <= max_len))


def _string(info: mi.StrType) -> st.SearchStrategy[str]:
    low = info.min_length or 0
    high = info.max_length
    if info.pattern is not None:
        return _pattern_text(info.pattern, low, high)
    return st.text(min_size=low, max_size=min(high if high is not None else 40, 40))


def _number_bounds(info: mi.IntType | mi.FloatType) -> tuple[Any, Any]:
    low = info.ge if info.ge is not None else info.gt
    high = info.le if info.le is not None else info.lt
    return low, high


def _integer(info: mi.IntType) -> st.SearchStrategy[int]:
    low, high = _number_bounds(info)
    if info.gt is not None:
        low = info.gt + 1
    if info.lt is not None:
        high = info.lt - 1
    return st.integers(
        min_value=low if low is not None else -(2**40),
        max_value=high if high is not None else 2**40,
    )


def _float(info: mi.FloatType) -> st.SearchStrategy[float]:
    low, high = _number_bounds(info)
    return st.floats(
        min_value=low if low is not None else -1e9,
        max_value=high if high is not None else 1e9,
        exclude_min=info.gt is not None,
        exclude_max=info.lt is not None,
        allow_nan=False,
        allow_infinity=False,
    )


def _field_strategy(
    struct: mi.StructType, field: mi.Field, overrides: Overrides
) -> st.SearchStrategy[Json]:
    for key in (f"{struct.cls.__name__}.{field.name}", field.name):
        if key in overrides:
            return overrides[key]
    return _from_info(field.type, overrides)


def _struct(info: mi.StructType, overrides: Overrides) -> st.SearchStrategy[dict[str, Json]]:
    required = {
        f.encode_name: _field_strategy(info, f, overrides) for f in info.fields if f.required
    }
    optional = {
        f.encode_name: _field_strategy(info, f, overrides) for f in info.fields if not f.required
    }
    body = st.fixed_dictionaries(required, optional=optional)
    if info.tag_field is None:
        return body
    tag_field, tag = info.tag_field, info.tag
    return body.map(lambda d: {tag_field: tag, **d})


def _from_info(info: mi.Type, overrides: Overrides) -> st.SearchStrategy[Json]:
    if isinstance(info, mi.StructType):
        return _struct(info, overrides)
    if isinstance(info, mi.UnionType):
        return st.one_of(*(_from_info(t, overrides) for t in info.types))
    if isinstance(info, mi.StrType):
        return _string(info)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.IntType):
        return _integer(info)
    if isinstance(info, mi.FloatType):
        return _float(info)
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.BytesType):
        raw = st.binary(min_size=info.min_length or 0, max_size=min(info.max_length or 64, 64))
        return raw.map(lambda b: base64.b64encode(b).decode())
    if isinstance(info, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        items = _from_info(info.item_type, overrides)
        return st.lists(items, min_size=info.min_length or 0, max_size=min(info.max_length or 3, 3))
    if isinstance(info, mi.DictType):
        keys = _from_info(info.key_type, overrides).filter(lambda k: isinstance(k, str))
        values = _from_info(info.value_type, overrides)
        return st.dictionaries(keys, values, max_size=min(info.max_length or 3, 3))
    if isinstance(info, mi.Metadata):
        return _from_info(info.type, overrides)
    if isinstance(info, mi.AnyType):
        return any_json()
    raise TypeError(f"no strategy for {info!r}: teach tests/wire_strategies.py this type")


def valid_json(tp: Any, overrides: Overrides | None = None) -> st.SearchStrategy[Json]:
    """JSON documents that decode as ``tp`` (those that do not are filtered out: a pattern
    hypothesis cannot match exactly, a bound a field's own check adds)."""
    documents = _from_info(mi.type_info(tp), overrides or {})
    return documents.filter(lambda doc: decodes(encode(doc), tp))


def valid(tp: Any, overrides: Overrides | None = None) -> st.SearchStrategy[bytes]:
    """Encoded documents that decode as ``tp``."""
    return valid_json(tp, overrides).map(encode)


# --- the bad kinds ------------------------------------------------------------------


def encode(doc: Json) -> bytes:
    """``doc`` as a publisher might write it: NaN and infinities as ``json.dumps`` does
    (not JSON: a decoder must refuse them), lone surrogates escaped."""
    return json.dumps(doc, allow_nan=True).encode()


def decodes(data: bytes, tp: Any) -> bool:
    """Whether ``data`` decodes as ``tp`` with msgspec (what the services' decoders do)."""
    try:
        msgspec.json.decode(data, type=tp)
    except (msgspec.MsgspecError, RecursionError):  # msgspec's depth limit: not a MsgspecError
        return False
    return True


_WRONG_TYPES: tuple[Json, ...] = (None, True, 0, -1, 1.5, "x", [], {}, [1, 2], {"a": 1})
_BAD_NUMBERS: tuple[float, ...] = (
    -1,
    -1e-9,
    -(2**63),
    2**64,
    10**30,
    1e308,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
)


def _dict_paths(doc: Json, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths to every object inside ``doc`` (the root included)."""
    if not isinstance(doc, dict):
        return []
    found = [path]
    for key, value in doc.items():
        found += _dict_paths(value, (*path, key))
    return found


def _at(doc: dict[str, Json], path: tuple[str, ...]) -> dict[str, Json]:
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def _mutated(draw: st.DrawFn, documents: st.SearchStrategy[Json]) -> Json:
    doc = json.loads(json.dumps(draw(documents)))  # a deep copy
    target = _at(doc, draw(st.sampled_from(_dict_paths(doc))))
    keys = sorted(target)
    kind = draw(
        st.sampled_from(
            ["drop", "wrong-type", "extra", "tag", "number", "hostile", "huge"]
            if keys
            else ["extra", "tag"]
        )
    )
    key = draw(st.sampled_from(keys)) if keys else ""
    if kind == "drop":
        del target[key]
    elif kind == "wrong-type":
        target[key] = draw(st.sampled_from(_WRONG_TYPES))
    elif kind == "extra":
        target[draw(hostile_text())] = draw(any_json())
    elif kind == "tag":
        target["type"] = draw(st.one_of(hostile_text(), st.sampled_from(_WRONG_TYPES)))
    elif kind == "number":
        target[key] = draw(st.sampled_from(_BAD_NUMBERS))
    elif kind == "hostile":
        target[key] = draw(hostile_text())
    else:
        target[key] = "x" * draw(st.sampled_from([1_000, 70_000, 300_000]))
    return doc


def near_valid(tp: Any, overrides: Overrides | None = None) -> st.SearchStrategy[bytes]:
    """A valid document with one thing wrong (which may or may not make it invalid: the
    test asks the type)."""
    return _mutated(valid_json(tp, overrides)).map(encode)


def garbage() -> st.SearchStrategy[bytes]:
    """Bytes that are not a document of any type: random bytes, invalid UTF-8, truncated
    or non-object JSON, deep nesting, NaN literals."""
    return st.one_of(
        st.binary(max_size=512),
        st.sampled_from(
            [
                b"",
                b"null",
                b"{",
                b"{}",
                b"[]",
                b"\xff\xfe\x00",
                b'{"type": "\xc3\x28"}',
                b"NaN",
                b'{"a": Infinity}',
                b"[" * 5000 + b"]" * 5000,
                b'{"a":' * 3000 + b"1" + b"}" * 3000,
            ]
        ),
        any_json().map(encode),
    )


def oversized(sizes: tuple[int, ...]) -> st.SearchStrategy[bytes]:
    """A JSON object of about each of ``sizes`` bytes (a service's own cap and beyond,
    near the server's max_payload)."""

    def padded(size: int) -> bytes:
        return b'{"type": "x", "pad": "' + b"x" * max(0, size - 24) + b'"}'

    return st.sampled_from(sizes).map(padded)


def message(
    tp: Any, overrides: Overrides | None = None, sizes: tuple[int, ...] = ()
) -> st.SearchStrategy[bytes]:
    """Any kind of message for a subject carrying ``tp``: valid, near-valid, garbage,
    and (with ``sizes``) oversized."""
    kinds = [valid(tp, overrides), near_valid(tp, overrides), garbage()]
    if sizes:
        kinds.append(oversized(sizes))
    return st.one_of(*kinds)


_TOKEN = re.compile(r"^[^\s*>.]+$")


MAX_TOKEN_CHARS = 512
"""Longer tokens are left out: the server closes a connection whose protocol line passes
its max_control_line (4 KiB), so no client can publish on such a subject at all."""


def is_subject_token(text: str) -> bool:
    """Whether ``text`` can be one token of a NATS subject a client may publish to."""
    return (
        bool(_TOKEN.match(text))
        and text.isascii()
        and text.isprintable()
        and len(text) <= MAX_TOKEN_CHARS
    )
