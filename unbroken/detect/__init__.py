"""Failure detection, classification, the retry chain and the operational report.

Supervisor side: `Detector` (fed heartbeats/exits/probes, polled with `check`), `classify`
with an `OffenderTable`, `RetryChain`. Worker side: `Heartbeat`, `numerics_check`.
Report side: `unbroken report` (`detect.command`), built on `detect.report.analyze`.
"""
from unbroken.detect.classify import Decision, ExclusionPolicy, OffenderTable, classify
from unbroken.detect.detectors import FAULTS, Detector, DetectorConfig, Finding, numerics_check
from unbroken.detect.retry import Attempt, RetryChain, RetryPolicy
from unbroken.detect.signals import (Heartbeat, HealthProbe, HostSignals, NvidiaSmiProbe, ProbeResult,
                                     read_host_signals, read_proc_state)

__all__ = ["FAULTS", "Attempt", "Decision", "Detector", "DetectorConfig", "ExclusionPolicy", "Finding",
           "Heartbeat", "HealthProbe", "HostSignals", "NvidiaSmiProbe", "OffenderTable", "ProbeResult",
           "RetryChain", "RetryPolicy", "classify", "numerics_check", "read_host_signals", "read_proc_state"]
