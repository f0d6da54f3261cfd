"""The control plane: server health and the watchdog, pausing and resuming servers' workers,
parity checks, reconcile of what the broker lost, and compaction of finished token arrays."""
