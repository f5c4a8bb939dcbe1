"""The shadow's wait: built and connected, it blocks until the supervisor assigns it a rank.

A shadow is the job's own script started ahead of time; it stops inside its first
unbroken call (`Trainer(model, optimizer)`), after the model and buffers exist, and waits here.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

from unbroken.runtime import membership
from unbroken.runtime.context import ProcessContext


def wait_for_assignment(ctx: ProcessContext, poll_s: float = 30.0) -> tuple[int, membership.Generation]:
    """Block until the leader assigns this shadow a rank (the store wakes us at once); every
    `poll_s` look for the job's end (the supervisor also stops its shadows itself). Each
    timed-out wait logs two c10d warning lines, shown if this shadow later takes a --tee rank."""
    store = ctx.store
    store.set(f"ready/{ctx.proc}", str(os.getpid()))
    ctx.events.emit("process_started", pid=os.getpid(), role="shadow", proc=ctx.proc, cold=False)
    ctx.set_phase("standby", 0)
    key = f"assign/{ctx.proc}"
    while True:
        if store.check([key]):
            a = membership.get(store, key)
            gen = membership.read_generation(store, int(a["gen"]), ctx.config.collective_timeout_s)
            return int(a["rank"]), gen
        if store.check(["shutdown"]):
            sys.exit(0)
        try:
            store.wait([key], timedelta(seconds=poll_s))
        except RuntimeError:
            time.sleep(0.001)
