"""The job store: request parsing, results storage (and, from other modules, the database side)."""
