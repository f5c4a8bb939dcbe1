"""Host staging of a snapshot: reused host buffers, filled by an async device-to-host copy.

For CUDA tensors the buffers are pinned and the copies run on a side stream after the
compute stream's pending work, so the training thread returns at once; `ready()` (the
background writer) waits for them. The compute stream waits for the copy before its next
kernel, so nothing overwrites the state while it is being read (a GPU-side wait: the host
thread keeps going). CPU tensors take the same path with no stream: a plain copy, ready at once.
"""
from __future__ import annotations

import time

import torch


class StagingTimeout(TimeoutError):
    """The device-to-host copy of a snapshot did not finish in time."""


class HostStaging:
    """One set of host buffers, named like the tensors they stage; reused while shapes stay."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._done: list = []  # CUDA events of the copies in flight
        self._streams: dict[torch.device, object] = {}  # one side stream per device

    def copy(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start copying `tensors` into the buffers (a new buffer where a shape or dtype changed)."""
        buffers: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                # pinned host memory makes the copy from an accelerator an async DMA
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
            buffers[name] = buf
        self.buffers = buffers
        by_device: dict[torch.device, list[str]] = {}
        for name, t in tensors.items():
            by_device.setdefault(t.device, []).append(name)
        self._done = []
        for device, names in by_device.items():
            if device.type == "cuda":
                self._done.append(self._copy_on_side_stream(device, [(self.buffers[n], tensors[n]) for n in names]))
            else:
                for n in names:
                    self.buffers[n].copy_(tensors[n].detach())

    def _copy_on_side_stream(self, device: torch.device, pairs: list) -> object:
        side = self._streams.setdefault(device, torch.cuda.Stream(device))
        compute = torch.cuda.current_stream(device)
        side.wait_stream(compute)  # the state as of the compute stream's pending kernels
        with torch.cuda.stream(side):
            for buf, t in pairs:
                buf.copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        compute.wait_event(done)  # no later kernel writes the state before it has been read
        return done

    def ready(self, timeout_s: float) -> dict[str, torch.Tensor]:
        """The buffers, once every copy has landed; StagingTimeout after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        for ev in self._done:
            while not ev.query():
                if time.monotonic() > deadline:
                    raise StagingTimeout(f"the device-to-host copy of a snapshot did not finish within {timeout_s:.1f}s")
                time.sleep(0.0005)
        return self.buffers
