"""A helper package outside the kernel package (as a vendored library would be): the
kernel's compile function imports it; ``[build] preload`` imports it once per worker."""
