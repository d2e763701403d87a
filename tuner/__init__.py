"""slotune's tuner package (see ../shared/DESIGN.md)."""
