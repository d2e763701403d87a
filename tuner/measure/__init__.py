"""Measurement and statistics: one measurement of a config at a rate, its intervals, capacity, the machine's floor, the paired verdict, step statistics."""
