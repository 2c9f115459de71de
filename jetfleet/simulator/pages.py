"""HTML bodies the simulated target serves."""

from __future__ import annotations

import random
from html import escape

CONTENT_ID = "content"
CHALLENGE_ID = "challenge"

_WORDS = (
    "alpha", "basalt", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "island",
    "juniper", "kestrel", "lagoon", "meadow", "nectar", "orchid", "prairie", "quartz",
    "river", "summit", "tundra", "umber", "valley", "willow", "xenon", "yarrow", "zephyr",
)  # fmt: skip

ROBOTS_TXT = "User-agent: *\nDisallow: /private/\nAllow: /\n"


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _links(n: int, pages: int) -> list[int]:
    # Spread links across the page space so a crawler following them fans out.
    if pages <= 0:
        return []
    return sorted({(n + 1) % pages, (n * 7 + 3) % pages, (n * 31 + 11) % pages} - {n})


def _document(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n</head>\n<body>\n{body}</body>\n</html>\n"
    )


def page_html(n: int, pages: int, *, with_content: bool = True) -> str:
    """Renders page ``n``; the same ``n`` always gives the same bytes.

    Args:
        n: Page number.
        pages: How many pages exist, so links stay in range.
        with_content: Whether to include ``<div id="content">``; without it the page
            looks like a site that removed the element a crawler selects.

    Returns:
        The HTML document.
    """
    # A per-page seed keeps content stable across runs and processes.
    rng = random.Random(n)
    title = f"Page {n}: {_sentence(rng, 3)[:-1]}"
    paragraphs = "".join(f"<p>{_sentence(rng, rng.randint(8, 16))}</p>\n" for _ in range(3))
    links = "".join(f'<li><a href="/page/{k}">Page {k}</a></li>\n' for k in _links(n, pages))
    container = f'<div id="{CONTENT_ID}">' if with_content else '<div id="main">'
    body = (
        f"<h1>{escape(title)}</h1>\n{container}\n{paragraphs}</div>\n"
        f'<ul class="links">\n{links}</ul>\n'
    )
    return _document(title, body)


def missing_html(path: str) -> str:
    """Renders a 404 page for ``path``."""
    return _document("Not found", f"<h1>Not found</h1>\n<p>{escape(path)} does not exist.</p>\n")


def blocked_html() -> str:
    """Renders a 403 block page, as a bot-protection front end would."""
    return _document(
        "Access denied",
        '<h1>Access denied</h1>\n<p class="block">Your requests have been blocked.</p>\n',
    )


def challenge_html() -> str:
    """Renders an unsolvable challenge page; a crawler must back off when it sees one."""
    return _document(
        "Just a moment...",
        f'<div id="{CHALLENGE_ID}">\n<h1>Checking your browser</h1>\n'
        "<p>Please wait while we verify you are human.</p>\n</div>\n",
    )


def error_html(status: int) -> str:
    """Renders a bare error page for ``status``."""
    return _document(f"Error {status}", f"<h1>Error {status}</h1>\n")


def big_html(n: int, size: int) -> bytes:
    """Renders page ``n`` padded to exactly ``size`` bytes (at least its own length) of
    ASCII HTML; the same ``n`` and ``size`` always give the same bytes."""
    rng = random.Random(n)
    head = f'<!DOCTYPE html>\n<html lang="en">\n<head><title>Big page {n}</title></head>\n<body>\n'
    tail = "</body>\n</html>\n"
    filler = "".join(f"<p>{_sentence(rng, 12)}</p>\n" for _ in range(64))
    room = max(0, size - len(head) - len(tail))
    body = (filler * (room // len(filler) + 1))[:room]
    return (head + body + tail).encode()


THIRD_PARTY_PIXEL = "http://tracker.example.invalid/pixel.gif"
"""A third-party resource every shop page asks for (a browser worker never fetches it)."""


def shop_item_html(n: int, pages: int, *, removed: bool = False) -> str:
    """Renders product ``n`` of the shop: stable selectors for a browser job.

    ``h1.title`` (the name), ``.price`` (absent when ``removed``: the site dropped the
    element a job waits for), ``ul.related a`` (links with ``href``), ``#visitor`` (what
    this browser's localStorage and cookies held before the visit: ``new`` or the name
    its first visit stored from ``?visitor=``), an image of the site and a third-party
    pixel (sub-resources), and an inline script that fills ``#visitor``.
    """
    rng = random.Random(10_000 + n)
    name = f"Item {n}: {_sentence(rng, 2)[:-1]}"
    price = f"{rng.randint(1, 499)}.{rng.randint(0, 99):02d}"
    related = "".join(f'<li><a href="/shop/item/{k}">Item {k}</a></li>\n' for k in _links(n, pages))
    price_html = "" if removed else f'<p class="price" data-currency="EUR">{price}</p>\n'
    body = (
        f'<h1 class="title">{escape(name)}</h1>\n{price_html}'
        f'<img class="photo" src="/shop/img/{n}.png" alt="">\n'
        f'<img class="pixel" src="{THIRD_PARTY_PIXEL}" alt="">\n'
        f'<ul class="related">\n{related}</ul>\n'
        '<p id="visitor"></p>\n'
        "<script>\n"
        'const seen = localStorage.getItem("shop_visitor");\n'
        'const cookie = document.cookie.split("; ").find(c => c.startsWith("shop_visitor="));\n'
        'document.getElementById("visitor").textContent = '
        '(seen || "new") + " " + (cookie ? cookie.split("=")[1] : "new");\n'
        'const asked = new URLSearchParams(location.search).get("visitor");\n'
        "if (asked && !seen) {\n"
        '  localStorage.setItem("shop_visitor", asked);\n'
        '  document.cookie = "shop_visitor=" + asked + "; path=/; max-age=86400";\n'
        "}\n"
        "</script>\n"
    )
    return _document(name, body)


SHOP_TRAPS = ("navigates", "challenge", "surrogates", "huge", "preconnect", "busy")
"""Hostile shop pages (``/shop/trap/NAME``) a browser job must survive politely."""


BUSY_FOR_MS = 12000
"""How long the ``busy`` trap page holds its main thread in spells, from its load on: past
any visit of it in the tests (its browser stops it when the visit closes the page), so
however late a loaded machine lets a wait for the load end, a spell follows."""


def shop_trap_html(name: str, n: int, to: str = THIRD_PARTY_PIXEL) -> str:
    """Renders hostile shop page ``name`` (one of ``SHOP_TRAPS``), all with ``h1.title``:

    ``navigates``: leaves for ``/shop/item/N`` by every means a page has (a script's
    ``location``, a meta refresh, a link click, a form post, a popup, a ping, a beacon,
    speculation rules, prefetch and preconnect hints, a favicon);
    ``challenge``: a challenge page served as 200 (``id="challenge"``) that also has the
    ``h1.title`` a job waits for;
    ``surrogates``: a title and text with lone UTF-16 surrogates (not encodable as UTF-8);
    ``huge``: an inline script that builds ``N`` paragraphs of 100 000 characters each;
    ``preconnect``: preconnect and DNS-prefetch hints for the origin of ``to`` (a
    connection, never a request: no policy of the page's stops it);
    ``busy``: from its load on, an inline script holds the main thread in spells of
    ``N`` hundred ms, 30 ms apart, for ``BUSY_FOR_MS`` (a script-heavy page, or a machine
    too loaded to run it: whatever asks the page waits for a gap).
    """
    item = f"/shop/item/{n}"
    if name == "navigates":
        body = (
            '<h1 class="title">Leaving</h1>\n'
            f'<a id="away" href="{item}?by=click" ping="{item}?by=ping">away</a>\n'
            f'<form id="post" method="post" action="{item}?by=form"></form>\n'
            f'<iframe src="{item}?by=iframe"></iframe>\n'
            '<script type="speculationrules">{"prerender": [{"source": "list", "urls": '
            f'["{item}?by=prerender"]}}], "prefetch": [{{"source": "list", "urls": '
            f'["{item}?by=prefetch-rule"]}}]}}</script>\n'
            "<script>\n"
            f'navigator.sendBeacon("{item}?by=beacon");\n'
            f'window.open("{item}?by=popup");\n'
            'document.getElementById("away").click();\n'
            'document.getElementById("post").submit();\n'
            f'setTimeout(() => {{ location.href = "{item}?by=location"; }}, 20);\n'
            "</script>\n"
        )
        head = (
            f'<meta http-equiv="refresh" content="0; url={item}?by=refresh">\n'
            f'<link rel="icon" href="{item}?by=favicon">\n'
            f'<link rel="prefetch" href="{item}?by=prefetch">\n'
            f'<link rel="preload" as="fetch" href="{item}?by=preload">\n'
            f'<link rel="preconnect" href="{THIRD_PARTY_PIXEL}">\n'
        )
        return _document_with_head("Leaving", head, body)
    if name == "preconnect":
        hints = f'<link rel="preconnect" href="{escape(to)}">\n'
        hints += f'<link rel="dns-prefetch" href="{escape(to)}">\n'
        return _document_with_head("Preconnect", hints, '<h1 class="title">Hints</h1>\n')
    if name == "challenge":
        return _document(
            "Just a moment...",
            f'<div id="{CHALLENGE_ID}">\n<h1 class="title">Checking your browser</h1>\n'
            "<p>Please wait while we verify you are human.</p>\n</div>\n",
        )
    if name == "surrogates":
        return _document(
            "Surrogates",
            '<h1 class="title"></h1>\n<script>\n'
            'document.title = "lone \\ud800 high";\n'
            'document.querySelector("h1").textContent = "lone \\udfff low";\n'
            "</script>\n",
        )
    if name == "huge":
        return _document(
            "Huge",
            '<h1 class="title">Huge</h1>\n<script>\n'
            f"for (let i = 0; i < {n}; i++) {{\n"
            '  const p = document.createElement("p");\n'
            '  p.className = "huge";\n'
            '  p.textContent = "x".repeat(100000);\n'
            "  document.body.appendChild(p);\n"
            "}\n</script>\n",
        )
    if name == "busy":
        return _document(
            "Busy",
            '<h1 class="title">Busy</h1>\n<script>\n'
            f"const until = Date.now() + {BUSY_FOR_MS};\n"
            "function spell() {\n"
            f"  const end = Date.now() + {min(n * 100, BUSY_FOR_MS)};\n"
            "  while (Date.now() < end) {}\n"
            # Gaps of 30 ms fit a frame: a wait for the load (polled on frames) ends in
            # the first, and what is asked of the page next meets the next spell.
            "  if (Date.now() < until) setTimeout(spell, 30);\n"
            "}\n"
            'addEventListener("load", () => setTimeout(spell, 0));\n'
            "</script>\n",
        )
    raise ValueError(f"no shop trap {name!r} (one of {', '.join(SHOP_TRAPS)})")


def _document_with_head(title: str, head: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n{head}</head>\n<body>\n{body}</body>\n</html>\n"
    )
