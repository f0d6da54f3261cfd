"""Results out of the ledger: SpecForge and conversations exports, Parquet shards and
object storage, and `tokenmill verify`'s checks."""
