"""What a worker says at start about its manners: the targets whose robots.txt it will
not obey (and the operator's reason), and a User-Agent that names no contact.

A User-Agent without a contact is warned about, not refused: the placeholder default
and the tests' loopback agents have none, and refusing would stop every dev stack. The
warning names the key to set. Sites need a way to reach the operator; docs/scope.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from jetfleet.settings import DEFAULT_USER_AGENT, Settings

_CONTACT = re.compile(r"https?://[^\s)]+|[^\s@()<>]+@[^\s@()<>]+\.[a-z]{2,}", re.IGNORECASE)


def names_contact(user_agent: str) -> bool:
    """Whether ``user_agent`` carries a contact: an http(s) URL or an e-mail address."""
    return bool(_CONTACT.search(user_agent))


def start_warnings(settings: Settings, targets: Iterable[str]) -> list[str]:
    """One line per target that does not obey robots.txt, and per User-Agent the
    worker sends that is the placeholder default or names no contact."""
    lines: list[str] = []
    agents: dict[str, list[str]] = {}
    for name in targets:
        target = settings.targets[name]
        if not target.obey_robots:
            lines.append(
                f"targets.{name}: robots.txt is NOT obeyed (obey_robots = false): "
                f"{target.robots_off_reason.strip()}"
            )
        agents.setdefault(target.user_agent or settings.fleet.user_agent, []).append(name)
    for agent, users in agents.items():
        own = agent != settings.fleet.user_agent
        key = f"targets.{users[0]}.user_agent" if own else "fleet.user_agent"
        if agent == DEFAULT_USER_AGENT:
            lines.append(
                f"User-Agent for {', '.join(users)} is the placeholder {agent!r}: set "
                f"{key} to name you and a contact (a URL or an e-mail address), so a "
                "site's owner can reach you"
            )
        elif not names_contact(agent):
            lines.append(
                f"User-Agent {agent!r} for {', '.join(users)} names no contact: add a URL "
                f"or an e-mail address to {key}, so a site's owner can reach you"
            )
    return lines
