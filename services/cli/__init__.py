"""The `keel` command line."""
