"""The `baton` command line."""
