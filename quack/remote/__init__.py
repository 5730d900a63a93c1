"""The shared, signed remote cache tier (issue 11): backends by URL
(``redis://``, ``s3://``, ``file://``), the signed object format, and the tier
that sits between the local store and a compile. See docs/remote-cache.md.

Nothing here is imported unless a remote is configured."""
