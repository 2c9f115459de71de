"""A challenge discards the cookies the identity's jar would send to that target, and
only those: a cookie of another target on the same host, scoped to that target's path,
is kept. No servers (the jar wants a running loop)."""

from __future__ import annotations

import json
import stat
from http.cookies import SimpleCookie
from pathlib import Path

from yarl import URL

from jetfleet.settings import TargetSettings
from jetfleet.worker.identity_cookies import COOKIES_FILE, IdentityCookies


def _set(cookies: IdentityCookies, url: str, name: str, path: str) -> None:
    morsel = SimpleCookie()
    morsel[name] = "v-" + name
    morsel[name]["path"] = path
    cookies.jar.update_cookies(morsel, URL(url))


async def test_a_challenge_keeps_the_cookies_of_another_target_on_the_same_host(
    tmp_path: Path,
) -> None:
    cookies = IdentityCookies("alice", str(tmp_path))
    shop = TargetSettings(base_url="https://site.example/shop/")
    _set(cookies, "https://site.example/shop/cart", "whole-site", "/")
    _set(cookies, "https://site.example/shop/cart", "shop", "/shop")
    _set(cookies, "https://site.example/shop/cart", "cart", "/shop/cart")
    _set(cookies, "https://site.example/blog/post", "blog", "/blog")
    _set(cookies, "https://site.example/shopping/", "shopping", "/shopping")
    _set(cookies, "https://other.example/", "other-host", "/")
    assert cookies.discard_for(shop) == 3
    assert sorted(m.key for m in cookies.jar) == ["blog", "other-host", "shopping"]
    saved = tmp_path / COOKIES_FILE
    assert "v-blog" in json.dumps(json.loads(saved.read_text())), "not saved as JSON"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600


async def test_a_challenge_discards_every_cookie_of_a_redirect_host(tmp_path: Path) -> None:
    cookies = IdentityCookies("alice", str(tmp_path))
    shop = TargetSettings(
        base_url="https://site.example/shop/", redirect_hosts=("login.example:443",)
    )
    _set(cookies, "https://login.example/sso/", "sso", "/sso")
    _set(cookies, "https://site.example/blog/", "blog", "/blog")
    assert cookies.discard_for(shop) == 1
    assert [m.key for m in cookies.jar] == ["blog"]
