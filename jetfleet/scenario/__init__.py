"""``jetfleet scenario``: the leasing walkthrough, replayed against the real services."""
