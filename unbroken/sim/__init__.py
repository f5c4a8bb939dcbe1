"""Cluster-scale failure simulator: how much of the wall clock each recovery policy keeps productive.

`run_policy` simulates one seeded run, `monte_carlo` many seeds with confidence
intervals; `unbroken simulate` (sim/command.py) is the command line.
"""
from unbroken.sim.engine import RunResult, run_policy
from unbroken.sim.errors import SimError
from unbroken.sim.montecarlo import Summary, monte_carlo
from unbroken.sim.policies import POLICY_NAMES, make_policy
from unbroken.sim.rates import FailureClass, FailureMix, default_mix, load_mix

__all__ = ["FailureClass", "FailureMix", "POLICY_NAMES", "RunResult", "SimError", "Summary",
           "default_mix", "load_mix", "make_policy", "monte_carlo", "run_policy"]
