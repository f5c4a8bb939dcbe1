"""Suite-wide settings: hypothesis runs derandomized, so CI sees the same examples every run;
the test process leaves without interpreter teardown (see pytest_unconfigure)."""
import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("unbroken", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("unbroken")

_status = {"code": 0}


def pytest_sessionfinish(session, exitstatus):
    _status["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """In-process TCPStores and gloo groups (unit tests of the heartbeat, fault log, fence)
    keep native threads that may abort in their C++ destructors at interpreter teardown
    ("terminate called without an active exception", exit 134) after every test passed.
    The runtime's own processes skip teardown for the same reason (runtime/launch.py);
    so does the test process, with the session's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status["code"])
