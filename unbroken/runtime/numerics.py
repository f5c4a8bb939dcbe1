"""Non-finite gradients: the step is redone from protected state, never applied; the policy
once the retries are spent (`stop` or `skip`). A mixin of `Trainer` (runtime/worker.py)."""
from __future__ import annotations

import time

from unbroken.detect.detectors import numerics_check
from unbroken.runtime import crash


class NumericsFault(RuntimeError):
    """The averaged gradient holds NaN/Inf: the step is redone, never applied."""


class NonFiniteGradient(RuntimeError):
    """The averaged gradient of one step stayed NaN/Inf past `nonfinite_retries` redos and the
    policy is `stop`: the message names the step and the first non-finite tensor."""


class NumericsChecks:
    def _nonfinite_vote(self, t: int) -> float:
        """1 when this rank has redone step t for a non-finite gradient `nonfinite_retries` times. It
        rides in the all-reduce: every rank then sees the same verdict, a new member included."""
        return 1.0 if self._nonfinite_tries.get(t, 0) >= self.cfg.nonfinite_retries else 0.0

    def _check_numerics(self, t: int, loss: float, norm: float) -> None:
        """NaN/Inf in the averaged gradient: record, then redo the step (never apply it); once
        the retries are spent, apply `on_nonfinite` (stop: NonFiniteGradient; skip: return)."""
        f = numerics_check(loss, norm, self._norms, proc=self.ctx.proc, rank=self.rank, node=self.ctx.node,
                           step=t, now=time.time())
        if f is None:
            self._norms.append(norm)
            del self._norms[:-200]
            return
        nonfinite = f.evidence.get("what") != "grad_spike"
        if self.rank == 0:  # the averaged gradient is the same everywhere: one rank reports
            ev = self.ctx.events
            ev.emit("fault_detected", **f.event_fields())
            ev.emit("fault_classified", fault="numerics", cls="operable", action="in_place" if nonfinite else "none",
                    reason="non-finite gradient: the step is redone from protected state, never applied"
                    if nonfinite else "gradient-norm spike: recorded; clipping bounds the update")
        if not nonfinite:
            return
        flat = self.owned.flat
        if float(flat.grads[flat.vote]) <= 0:  # no rank has spent its retries on this step yet
            self._nonfinite_tries[t] = self._nonfinite_tries.get(t, 0) + 1
            raise NumericsFault(f"non-finite averaged gradient at step {t} ({f.evidence.get('what')})")
        self._nonfinite_policy(t, loss)

    def _nonfinite_policy(self, t: int, loss: float) -> None:
        flat, cfg = self.owned.flat, self.cfg
        tensor = flat.first_nonfinite(flat.grads[:flat.n]) or "the loss"
        attempts = self._nonfinite_tries.get(t, 0) + 1
        if self.rank == 0:
            self.ctx.events.emit("nonfinite", step=t, tensor=tensor, attempts=attempts, action=cfg.on_nonfinite)
        if cfg.on_nonfinite == "skip":
            return  # the step's scalars say skip: every chunk keeps its bytes, the step counts as done
        msg = (f"step {t}: the averaged gradient stayed non-finite over {attempts} attempts (first non-finite "
               f"tensor: {tensor}; loss {loss}); the same batch fails every time: fix the data or model at "
               "this step, or rerun with --on-nonfinite skip")
        crash.declare_fatal(self.ctx, msg, leader=self.rank == 0)
        raise NonFiniteGradient(msg)
