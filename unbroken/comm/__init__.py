"""Collectives: one generation's process group with bounded waits (group.py); our own all-reduce over
point-to-point transfers (transport.py, patterns.py), flow statistics (flows.py), the planner
(planner.py), the congestion-aware all-reduce that uses them (adaptive.py) and its per-bucket
front for the gradient hooks (bucketed.py)."""
