"""The bounded names and keys the request/reply types carry.

Each bound is generous enough that every message a jetfleet worker or operator tool has
sent stays valid (a compatible evolution), and tight enough that a name is safe as a
subject token, a KV key or a metric label.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from jetfleet.subjects import TARGET_NAME_RE

TargetName = Annotated[str, msgspec.Meta(pattern=TARGET_NAME_RE.pattern)]
"""A declared target's name: lowercase letters, digits, ``-`` and ``_``, at most 64,
starting with a letter or digit (what settings accept for ``[targets.<name>]``)."""

MAX_NAME_CHARS = 256
"""As long as a job's ``pin_identity`` may be, so every pinned identity can be owned."""
_NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS, pattern=_NO_CONTROL)]
"""A worker id, identity or region: free text (any name may be quarantined), at most 256
characters, no control characters (they would forge log lines)."""
RequiredName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS, pattern=_NO_CONTROL)
]
"""A ``Name`` that is not empty (a worker id, the scope of a quarantine)."""

IdempotencyKey = Annotated[
    str, msgspec.Meta(max_length=256, pattern=r"^[^\s*>.]+(?:\.[^\s*>.]+)*$")
]
"""A unit of work's key, the end of a subject (``jf.results.<target>.<key>``): at most
256 characters, no spaces or wildcards, no empty token (leading, trailing or doubled
dot). Derived keys are ``u-`` or ``x-`` and 40 hex digits."""

ReplySubject = Annotated[str, msgspec.Meta(max_length=1024, pattern=r"^[^\s*>]*$")]
"""A delivery's reply subject (``$JS.ACK...``) or empty: no spaces or wildcards, at most
1024 characters."""
