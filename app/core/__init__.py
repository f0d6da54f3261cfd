"""The core types every layer shares: settings, contracts, errors, the ledger's tables,
constants, logging, locks and the loopback check."""
