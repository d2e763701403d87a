"""slotune's tuner package (docs/architecture.md)."""
