"""What the CLI shows: the `status --watch` dashboard, the report page and its plots, tables that
fit a terminal, and the Prometheus exposition of the fleet."""
