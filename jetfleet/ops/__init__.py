"""Operator tools: status, doctor, dead letters and the wire contract's generated documents."""
