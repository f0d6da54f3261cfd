"""Object storage: fsspec filesystems from a URL and atomic object writes, the Parquet shards of
compacted runs, and the content-addressed image store; below the ledger and the outputs."""
