"""Helpers shared by the queueing tests (tiers, isolation, backpressure, I3)."""
