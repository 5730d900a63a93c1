"""The on-disk cache: keys and source fingerprints, file-system helpers, the store, the build journal."""
