"""The pytest plugin (overlaps compiles with tests)."""
