"""Dev tooling: the embedded servers and the local stack behind ``jetfleet dev`` and the tests.

The core (admission, leases, the commit, the worker) never imports from here.
"""
