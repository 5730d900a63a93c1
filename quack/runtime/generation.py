"""A counter bumped whenever settings change, so per-process memos
(``@jit_cache``'s in-memory table) know to drop what they hold."""

value = 0


def bump() -> None:
    global value
    value += 1
