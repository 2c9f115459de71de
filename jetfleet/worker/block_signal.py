"""Which answers of a target are block signals, and of what kind: one verdict for every
handler (``http.get`` reads it from the response, ``browser.page`` from the page).

Blocks and challenges are signals to back off and contain, never obstacles to get
around (docs/scope.md).
"""

from __future__ import annotations

BLOCK_STATUS = frozenset({403, 429, 503})
CHALLENGE_ID = "challenge"
"""The element id that marks a challenge page (in a page a browser shows)."""
CHALLENGE_MARKER = f'id="{CHALLENGE_ID}"'.encode()


def block_kind(status: int, body: bytes) -> str:
    """The kind of block a ``status`` in ``BLOCK_STATUS`` answered with ``body`` is:
    ``rate-limited`` (429, or a 503 without challenge markers), ``challenged`` (a page
    with challenge markers) or ``blocked`` (403)."""
    if status == 429:
        return "rate-limited"
    if is_challenge(body):
        return "challenged"
    return "blocked" if status == 403 else "rate-limited"


def is_challenge_page(body: bytes) -> bool:
    """Whether a page that answered 2xx is a challenge all the same: only its explicit
    marker counts (``is_challenge``'s looser test, the word anywhere near the top, would
    take any page about challenges for one, and back off from it for ever)."""
    return CHALLENGE_MARKER in body


def is_challenge(body: bytes) -> bool:
    """Whether ``body`` carries a challenge page's markers."""
    return CHALLENGE_MARKER in body or b"challenge" in body[:4096].lower()
