"""slotune's dashboards package (see ../shared/DESIGN.md)."""
