"""Test-only fault injection for the invariant tests (no fault knobs in product code).

``plan``: which job gets which fault, decided from a hash of its id (reproducible).
``worker``: a ``jetfleet.worker.Worker`` subclass that drops acks, suppresses renewals
and records what it saw, one JSON line per event.
``worker_main``: ``python -m tests.faults.worker_main`` runs that worker as a process.
``fleet``: starts, SIGKILLs, replaces and stops those processes from a test.
"""
