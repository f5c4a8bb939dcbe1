"""Collectives: one generation's process group with bounded waits (group.py)."""
