"""slotune's dashboards package (docs/architecture.md)."""
