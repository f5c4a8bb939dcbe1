"""gloo's collectives on device (CUDA) tensors, staged through host memory.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and gloo's own CUDA support
covers only some ops (not send/recv, whose buffers it would read as host memory). Ranks that
share a GPU (`--backend gloo --device cuda`) therefore run their data collectives here: each op
copies its device inputs to the host when it is issued (a synchronous copy: it waits for the
kernels that wrote them), runs gloo's op on the host copies, and when the op has finished
copies the outputs back and synchronizes that copy, so any stream may read them after.

The bits are gloo's on the host values: a staged job's collectives give what a CPU job's give
on the same inputs. `StagedGroup` offers exactly the ProcessGroup methods comm/group.py's Comm
calls, with the same arguments; the works it returns have the `wait()` Comm's waiter thread
uses. The copy back runs on that waiter thread, before the op counts as done.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class StagedWork:
    """A gloo work on host copies; `wait()` waits for it, then copies the outputs back to their device."""

    def __init__(self, work: dist.Work, back: list[tuple[torch.Tensor, torch.Tensor]],
                 keep: list[torch.Tensor] | None = None) -> None:
        self.work, self.back = work, [(dev, host) for dev, host in back if dev is not host]
        self.keep = keep or []  # host inputs gloo reads until the op ends

    def wait(self) -> None:
        self.work.wait()  # raises the op's error, if any: then nothing is copied back
        devices = set()
        for dev, host in self.back:
            if dev.device.type != "cuda":
                dev.copy_(host)  # a host tensor staged anyway (StagedGroup(always=True))
                continue
            with torch.cuda.device(dev.device):
                dev.copy_(host)
            devices.add(dev.device)
        for d in devices:  # the op is done only when its outputs are on the device, visible to every stream
            torch.cuda.synchronize(d)
        self.keep = []


class StagedGroup:
    """The methods of a gloo ProcessGroup that Comm uses, for tensors on a device."""

    def __init__(self, pg: dist.ProcessGroup, always: bool = False) -> None:
        self.pg = pg
        self.always = always  # stage host tensors too: tests the staging where no GPU is

    def _staged(self, t: torch.Tensor) -> bool:
        return self.always or t.device.type != "cpu"

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` to send from, or `t` itself when it already lives on the host."""
        return t.detach().to("cpu", copy=True) if self._staged(t) else t

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        """A host buffer to receive `t`'s result into, or `t` itself when it lives on the host."""
        return torch.empty(t.shape, dtype=t.dtype) if self._staged(t) else t

    def _rows(self, outs: list[list[torch.Tensor]]) -> tuple[list[list[torch.Tensor]], list]:
        """Host buffers for a gather's or all-gather's output rows, and the (device, host) pairs to copy back."""
        h_outs = [[self._buffer(t) for t in row] for row in outs]
        return h_outs, [pair for row, h_row in zip(outs, h_outs) for pair in zip(row, h_row)]

    def allreduce(self, ts: list[torch.Tensor], opts) -> StagedWork:
        hs = [self._host(t) for t in ts]
        return StagedWork(self.pg.allreduce(hs, opts), list(zip(ts, hs)))

    def broadcast(self, ts: list[torch.Tensor], opts) -> StagedWork:
        hs = [self._host(t) for t in ts]
        return StagedWork(self.pg.broadcast(hs, opts), list(zip(ts, hs)))

    def reduce(self, ts: list[torch.Tensor], opts) -> StagedWork:
        hs = [self._host(t) for t in ts]
        return StagedWork(self.pg.reduce(hs, opts), list(zip(ts, hs)))

    def send(self, ts: list[torch.Tensor], dst: int, tag: int) -> StagedWork:
        hs = [self._host(t) for t in ts]
        return StagedWork(self.pg.send(hs, dst, tag), [], keep=hs)

    def recv(self, ts: list[torch.Tensor], src: int, tag: int) -> StagedWork:
        hs = [self._buffer(t) for t in ts]
        return StagedWork(self.pg.recv(hs, src, tag), list(zip(ts, hs)))

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list,
                      opts) -> StagedWork:
        h_out, h_in = self._buffer(out), self._host(inp)
        return StagedWork(self.pg.alltoall_base(h_out, h_in, out_splits, in_splits, opts), [(out, h_out)],
                          keep=[h_in])

    def gather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts) -> StagedWork:
        (h_outs, back), h_ins = self._rows(outs), [self._host(t) for t in ins]
        return StagedWork(self.pg.gather(h_outs, h_ins, opts), back, keep=h_ins)

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor]) -> StagedWork:
        (h_outs, back), h_ins = self._rows(outs), [self._host(t) for t in ins]
        return StagedWork(self.pg.allgather(h_outs, h_ins), back, keep=h_ins)

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts) -> StagedWork:
        h_out, h_in = self._buffer(out), self._host(inp)
        return StagedWork(self.pg._reduce_scatter_base(h_out, h_in, opts), [(out, h_out)], keep=[h_in])
