"""docs/security.md shows the roles exactly as jetfleet/auth/roles.py defines them."""

from __future__ import annotations

from pathlib import Path

from jetfleet.auth.roles import ROLES_DOC_BEGIN, ROLES_DOC_END, roles_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def test_the_security_doc_lists_the_roles_as_the_code_grants_them() -> None:
    text = DOC.read_text()
    start = text.index(ROLES_DOC_BEGIN)
    end = text.index(ROLES_DOC_END) + len(ROLES_DOC_END) + 1
    assert text[start:end] == roles_markdown(), (
        "docs/security.md's roles table differs from jetfleet/auth/roles.py: replace it "
        "with the output of `jetfleet auth roles`"
    )
