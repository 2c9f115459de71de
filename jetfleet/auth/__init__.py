"""Who may do what: roles, their credentials, and the servers' auth files (docs/security.md)."""
