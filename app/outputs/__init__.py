"""Results out of the ledger: SpecForge, conversations and Parquet exports, `tokenmill verify`'s
checks, and the numbers reports and acceptance are made of (pure functions of the rows)."""
