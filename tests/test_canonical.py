"""Canonical URLs, idempotency keys and ``is_under``. Pure unit tests.

hypothesis is not installed here, so the property tests draw their cases from a seeded
``random.Random``: deterministic, yet many spellings per run.
"""

from __future__ import annotations

import hashlib
import random
import re
from urllib.parse import quote

import pytest

from jetfleet.canonical import canonical_url, idempotency_key, is_under

NATS_KV_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")


# --- canonical_url --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("HTTP://Example.ORG/a", "http://example.org/a"),
        ("hTTpS://WWW.Example.Org/Path/Is/Kept", "https://www.example.org/Path/Is/Kept"),
    ],
)
def test_scheme_and_host_are_lower_cased_but_the_path_keeps_its_case(
    url: str, canonical: str
) -> None:
    assert canonical_url(url) == canonical


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("http://example.org:80/a", "http://example.org/a"),
        ("https://example.org:443/a", "https://example.org/a"),
        ("http://example.org:443/a", "http://example.org:443/a"),
        ("https://example.org:80/a", "https://example.org:80/a"),
        ("https://example.org:8443/a", "https://example.org:8443/a"),
    ],
)
def test_only_the_schemes_default_port_is_dropped(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical


@pytest.mark.parametrize("fragment", ["#top", "#", "#a/b?c=d"])
def test_the_fragment_is_dropped(fragment: str) -> None:
    assert canonical_url(f"http://example.org/a?x=1{fragment}") == "http://example.org/a?x=1"


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("http://h/a?b=2&a=1", "http://h/a?a=1&b=2"),
        ("http://h/a?a=2&a=1&b=0", "http://h/a?a=1&a=2&b=0"),
        ("http://h/a?z=&y=1", "http://h/a?y=1&z="),
        ("http://h/a?q=a+b", "http://h/a?q=a+b"),
        ("http://h/a?q=a%20b", "http://h/a?q=a+b"),
        ("http://h/a?q=%7e", "http://h/a?q=~"),
        ("http://h/a?", "http://h/a"),
    ],
)
def test_the_query_is_sorted_and_its_encoding_normalised(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical


def test_an_encoded_ampersand_or_equals_in_a_query_value_stays_encoded() -> None:
    assert canonical_url("http://h/a?q=x%26y%3Dz") == "http://h/a?q=x%26y%3Dz"


@pytest.mark.parametrize(
    "url", ["http://example.org", "http://example.org?", "http://example.org#frag"]
)
def test_an_empty_path_becomes_a_slash(url: str) -> None:
    assert canonical_url(url) == "http://example.org/"


def test_an_empty_path_keeps_the_query() -> None:
    assert canonical_url("http://example.org?b=1&a=2") == "http://example.org/?a=2&b=1"


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("http://h/%7Euser", "http://h/~user"),  # unreserved: decoded
        ("http://h/%41%62c", "http://h/Abc"),
        ("http://h/caf%c3%a9", "http://h/caf%C3%A9"),  # hex digits upper-cased
        ("http://h/café", "http://h/caf%C3%A9"),  # non-ASCII: UTF-8, encoded
        ("http://h/a b", "http://h/a%20b"),
        ("http://h/a%20b", "http://h/a%20b"),
        ("http://h/100%25", "http://h/100%25"),  # a literal percent stays encoded
        ("http://h/a%3Fb", "http://h/a%3Fb"),  # an encoded '?' is part of the path
        ("http://h/a%23b", "http://h/a%23b"),  # an encoded '#' too
    ],
)
def test_percent_encoding_is_normalised(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical


def test_an_encoded_slash_is_not_a_path_separator() -> None:
    # RFC 3986 6.2.2.2: only unreserved characters may be decoded. "/a%2Fb" is one
    # segment, "/a/b" two: different resources, and aiohttp (yarl) requests them as
    # different paths. Decoding %2F gives both the same idempotency key, so the second
    # job would be suppressed as a duplicate of work that was never done.
    assert canonical_url("http://h/a%2Fb") == "http://h/a%2Fb"
    assert canonical_url("http://h/a%2fb") == "http://h/a%2Fb"
    assert idempotency_key("http.get", "http://h/a%2Fb") != idempotency_key(
        "http.get", "http://h/a/b"
    )


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("http://h/a/./b", "http://h/a/b"),
        ("http://h/a/b/../c", "http://h/a/c"),
        ("http://h/a/%2e%2e/c", "http://h/c"),
        ("http://h/../a", "http://h/a"),
    ],
)
def test_dot_segments_are_removed(url: str, canonical: str) -> None:
    # RFC 3986 6.2.2.3; aiohttp (yarl) removes them before it sends the request, so
    # "/a/b/../c" and "/a/c" are the same request and must be the same unit of work.
    assert canonical_url(url) == canonical


def test_an_ipv6_host_keeps_its_brackets() -> None:
    assert canonical_url("http://[::1]:8080/x") == "http://[::1]:8080/x"
    assert canonical_url("http://[::1]:80/x") == "http://[::1]/x"
    # Without brackets "[::1]:8080" and "[::1:8080]" would be spelled alike.
    assert canonical_url("http://[::1:8080]/x") != canonical_url("http://[::1]:8080/x")


def test_an_ipv6_host_that_reads_like_another_host_and_port_is_not_under_it() -> None:
    assert is_under("http://[::1]:8080/x", "http://[::1]:8080/")
    assert not is_under("http://[::1:8080]/x", "http://[::1]:8080/")


def test_surrounding_whitespace_is_ignored() -> None:
    assert canonical_url("  http://h/a \n") == "http://h/a"


def test_userinfo_is_not_part_of_the_canonical_url() -> None:
    # Credentials never end up in a key, a log or a result.
    assert canonical_url("http://user:secret@h/a") == "http://h/a"


def test_an_out_of_range_port_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        canonical_url("http://h:99999/a")


SAMPLES = [
    "HTTP://Example.ORG:80/a/b?b=2&a=1#frag",
    "https://example.org",
    "https://example.org:8443/x%7Ey?q=a+b&p=",
    "http://h/café/%e2%82%ac?z=1&z=0",
    "http://h/a b/c%20d",
    "http://h/100%25?x=%26",
]


@pytest.mark.parametrize("url", SAMPLES)
def test_canonicalising_twice_changes_nothing(url: str) -> None:
    once = canonical_url(url)
    assert canonical_url(once) == once


# --- spellings of the same work (property style, seeded) ------------------------------

_UNRESERVED_LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789-._~"


def _random_case(rng: random.Random, text: str) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in text)


def _maybe_encode(rng: random.Random, text: str) -> str:
    """Percent-encode some unreserved characters, in either hex case."""
    out = []
    for c in text:
        if c in _UNRESERVED_LETTERS and rng.random() < 0.3:
            code = f"%{ord(c):02X}"
            out.append(code.lower() if rng.random() < 0.5 else code)
        else:
            out.append(c)
    return "".join(out)


def _spelling(
    rng: random.Random, scheme: str, host: str, segments: list[str], query: list[tuple[str, str]]
) -> str:
    port = {"http": ":80", "https": ":443"}[scheme] if rng.random() < 0.5 else ""
    path = "/" + "/".join(_maybe_encode(rng, s) for s in segments)
    pairs = query[:]
    rng.shuffle(pairs)
    qs = "&".join(
        f"{quote(k)}={quote(v) if rng.random() < 0.5 else quote(v, safe='')}" for k, v in pairs
    )
    fragment = "#" + rng.choice(["", "top", "x/y"]) if rng.random() < 0.5 else ""
    url = f"{_random_case(rng, scheme)}://{_random_case(rng, host)}{port}{path}"
    return url + (f"?{qs}" if qs else "") + fragment


def _random_work(rng: random.Random) -> tuple[str, str, list[str], list[tuple[str, str]]]:
    scheme = rng.choice(["http", "https"])
    host = rng.choice(["example.org", "shop.example.com", "127.0.0.1"])
    segments = [
        "".join(rng.choice(_UNRESERVED_LETTERS) for _ in range(rng.randint(1, 8)))
        for _ in range(rng.randint(1, 4))
    ]
    query = [
        (rng.choice("abcxyz"), "".join(rng.choice("abc 123~") for _ in range(3)))
        for _ in range(rng.randint(0, 4))
    ]
    return scheme, host, segments, query


def test_the_same_work_spelled_differently_always_gets_the_same_key() -> None:
    rng = random.Random(20240611)
    for _ in range(300):
        work = _random_work(rng)
        spellings = {_spelling(rng, *work) for _ in range(6)}
        canonical = {canonical_url(s) for s in spellings}
        assert len(canonical) == 1, spellings
        keys = {idempotency_key("http.get", s) for s in spellings}
        assert len(keys) == 1, spellings


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://Example.org:80/a?b=2&a=1", "HTTP://example.ORG/a?a=1&b=2#frag"),
        ("https://h:443/%7Eu", "https://h/~u"),
        ("http://h", "http://h/"),
        ("http://h/caf%c3%a9", "http://h/café"),
        ("http://h/a?q=a+b", "http://h/a?q=a%20b"),
    ],
)
def test_known_spellings_of_the_same_work_share_a_key(one: str, other: str) -> None:
    assert idempotency_key("http.get", one) == idempotency_key("http.get", other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://h/a", "https://h/a"),
        ("http://h/a", "http://h:8080/a"),
        ("http://h/a", "http://g/a"),
        ("http://h/a", "http://h/A"),
        ("http://h/a", "http://h/a/"),
        ("http://h/a?x=1", "http://h/a?x=2"),
        ("http://h/a?x=1", "http://h/a"),
        ("http://h/a?x=1&x=2", "http://h/a?x=1"),
    ],
)
def test_different_work_gets_different_keys(one: str, other: str) -> None:
    assert idempotency_key("http.get", one) != idempotency_key("http.get", other)


def test_a_different_handler_is_different_work() -> None:
    assert idempotency_key("http.get", "http://h/a") != idempotency_key("noop", "http://h/a")


def test_a_different_pinned_identity_is_different_work() -> None:
    base = idempotency_key("http.get", "http://h/a")
    alice = idempotency_key("http.get", "http://h/a", pin_identity="alice")
    bob = idempotency_key("http.get", "http://h/a", pin_identity="bob")
    assert len({base, alice, bob}) == 3


def test_a_different_pinned_region_is_different_work_and_no_region_keeps_the_old_key() -> None:
    base = idempotency_key("http.get", "http://h/a")
    eu = idempotency_key("http.get", "http://h/a", pin_region="eu")
    us = idempotency_key("http.get", "http://h/a", pin_region="us")
    assert len({base, eu, us}) == 3
    # The key of a job without a region pin is the one it had before pins existed.
    assert base == "u-" + hashlib.sha256(b"http.get\n\nhttp://h/a").hexdigest()[:40]


def test_an_explicit_key_wins_over_handler_url_and_pin() -> None:
    one = idempotency_key("http.get", "http://h/a", "alice", explicit="order-42")
    other = idempotency_key("noop", "https://elsewhere/b", "bob", explicit="order-42")
    assert one == other
    assert one != idempotency_key("http.get", "http://h/a", "alice")


def test_different_explicit_keys_are_different_work() -> None:
    assert idempotency_key("http.get", "http://h/a", explicit="order-42") != idempotency_key(
        "http.get", "http://h/a", explicit="order-43"
    )


def test_an_explicit_key_never_collides_with_a_derived_one() -> None:
    derived = idempotency_key("http.get", "http://h/a")
    # Even an explicit key spelled like a derived key, or like the derived key's input.
    assert idempotency_key("x", "http://h/b", explicit=derived) != derived
    assert idempotency_key("x", "http://h/b", explicit="http.get\n\nhttp://h/a") != derived


def test_the_key_is_stable_across_calls() -> None:
    assert idempotency_key("http.get", "http://h/a") == idempotency_key("http.get", "http://h/a")


@pytest.mark.parametrize(
    "explicit",
    [
        "",
        "order-42",
        "has spaces and * > wildcards",
        "dots.at.end.",
        "ünïcødé €",
        "a/b\\c\n",
        "x" * 256,
        ".",
        "*",
        ">",
    ],
)
@pytest.mark.parametrize("url", [*SAMPLES, "http://h/ä ö?é=ü#ß"])
def test_keys_are_valid_nats_kv_keys(explicit: str, url: str) -> None:
    key = idempotency_key("http.get", url, pin_identity="ïd.entity *", explicit=explicit)
    assert NATS_KV_KEY.match(key), key
    assert not key.startswith(".") and not key.endswith(".")
    assert len(key) <= 64


def test_derived_and_explicit_keys_are_marked_by_their_prefix() -> None:
    assert idempotency_key("http.get", "http://h/a").startswith("u-")
    assert idempotency_key("http.get", "http://h/a", explicit="k").startswith("x-")


# --- is_under -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "under"),
    [
        ("http://h/page/x", True),
        ("http://h/page/x/y?q=1#f", True),
        ("http://h/page/", True),
        ("http://h/page", True),
        ("http://h/pages/x", False),
        ("http://h/page2", False),
        ("http://h/pag", False),
        ("http://h/", False),
        ("http://h/other/page/x", False),
    ],
)
def test_a_base_without_trailing_slash_is_a_path_prefix_on_segment_boundaries(
    url: str, under: bool
) -> None:
    assert is_under(url, "http://h/page") is under


@pytest.mark.parametrize(
    ("url", "under"),
    [
        ("http://h/page/x", True),
        ("http://h/page/", True),
        ("http://h/pages/x", False),
        ("http://h/pagex", False),
    ],
)
def test_a_base_with_trailing_slash_is_a_path_prefix(url: str, under: bool) -> None:
    assert is_under(url, "http://h/page/") is under


@pytest.mark.parametrize("base", ["http://h", "http://h/", "HTTP://H:80/"])
def test_a_root_base_covers_every_path_of_its_origin(base: str) -> None:
    assert is_under("http://h/", base)
    assert is_under("http://h/anything/at/all?x=1", base)
    assert is_under("http://h", base)


@pytest.mark.parametrize(
    "url",
    [
        "https://h/page/x",  # other scheme
        "http://h:8080/page/x",  # other port
        "http://g/page/x",  # other host
        "http://h.evil.example/page/x",  # host with the base's host as prefix
        "http://evil.example/h/page/x",
        "http://h@evil.example/page/x",  # userinfo trick
        "http://h:80@evil.example/page/x",
    ],
)
def test_another_origin_is_never_under_the_base(url: str) -> None:
    assert not is_under(url, "http://h/page/")


def test_is_under_compares_canonical_forms() -> None:
    assert is_under("HTTP://H:80/page/%78", "http://h/page/")
    assert is_under("https://h/page/x", "https://h:443/page")
    assert is_under("http://h/caf%c3%a9/x", "http://h/café/")


@pytest.mark.parametrize(
    "url",
    [
        "http://h/page/../secret",
        "http://h/page/%2e%2e/secret",
        "http://h/page/%2E%2E/%2e%2e/secret",
        "http://h/page/./../secret",
    ],
)
def test_dot_segments_cannot_climb_out_of_the_base(url: str) -> None:
    # aiohttp (yarl) resolves these to /secret before sending, so admitting them would
    # let a job fetch a path outside its target's base_url.
    assert not is_under(url, "http://h/page/")
