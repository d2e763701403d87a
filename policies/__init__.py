"""slotune's policies package (see ../shared/DESIGN.md)."""
