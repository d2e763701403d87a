"""slotune's loadtest package (see ../shared/DESIGN.md)."""
