"""What a ``browser.page`` job asks of its page, and what it found (docs/browser.md)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from jetfleet.schemas.stored import StoredObject

Selector = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
FieldName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
AttrName = Annotated[str, msgspec.Meta(max_length=128)]
MAX_EXTRACT_FIELDS = 64
MAX_VALUES_PER_FIELD = 1000


class Extract(msgspec.Struct, frozen=True, omit_defaults=True):
    """One value to read from the page: the text (or ``attr``) of the first element
    ``selector`` matches, or of every one with ``all``."""

    selector: Selector
    attr: AttrName = ""
    """An attribute to read (``href``, ``src``); empty reads the element's text."""
    all: bool = False
    """Every matching element (a list, at most ``MAX_VALUES_PER_FIELD``), not the first."""


class PageSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A ``browser.page`` job's instructions; its page is the job's ``url``."""

    wait_for: Selector | None = None
    """A selector the page must show before anything is read; one that never appears on
    a page that loaded (2xx) fails the job ``selector-removed``. None: read once loaded."""
    wait_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=300)] = 0.0
    """How long to wait for ``wait_for`` (a duration); 0 takes
    ``worker.browser.wait_timeout_s``."""
    extract: Annotated[dict[FieldName, Extract], msgspec.Meta(max_length=MAX_EXTRACT_FIELDS)] = {}
    """Name -> what to read under that name."""
    screenshot: bool = False
    """Keep a PNG of the viewport as a result attachment (within size caps)."""


ExtractedValue = str | list[str] | None
"""One field's value: text (or attribute), a list of them (``all``), or None when the
element (or its attribute) is not there."""


class PageVisit(msgspec.Struct, frozen=True, tag="page", omit_defaults=True):
    """The record of one ``browser.page`` visit."""

    status: int
    final_url: str
    title: str = ""
    values: dict[str, ExtractedValue] = {}
    screenshot: StoredObject | None = None
    """The PNG, in the result object store, when the job asked for one."""
    blocked_requests: int = 0
    """Requests the page tried beyond its document (sub-resources, other hosts, later
    navigations), aborted unsent (docs/browser.md#manners)."""
