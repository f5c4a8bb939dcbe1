"""What a Trainer writes to disk besides events: tier-2 checkpoints and layout.pt.

Tier 2 (protect/tier2.py) is written asynchronously every `checkpoint_every` steps, by
every rank for sharded state and by rank 0 for a replica; layout.pt (rank 0, at start)
maps the flat shards back onto the model's state_dict for `unbroken export`.
Manifests are signed with the job key (RUN_DIR/job.key, runtime/jobkey.py). At each
checkpoint the ranks AND a mask of the recent steps each committed (one int64 all-reduce)
and pin the newest common one, so retention never leaves the job without one.
"""
from __future__ import annotations

import io

import torch

from unbroken.fsutil import atomic_write_bytes
from unbroken.runtime import adopt
from unbroken.runtime.jobkey import JobKeyError, read_job_key


class Persistence:
    def _land_checkpoint(self, timeout_s: float = 10.0) -> None:
        """The script is ending in an exception: let the checkpoint in flight commit (its
        snapshot is of a committed step), so that a job that stops loses as little as it can."""
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.wait(timeout_s)

    def _write_layout(self) -> None:
        """layout.pt: how the flat shards map back onto the model's state_dict (unbroken export reads it):
        trained parameter names and shapes in flat order, the shard size, the buffers' names,
        dtypes and shapes (encoded in checkpoints' `buffers`), and everything else of the
        state_dict as it was at start (frozen parameters, those the optimizer does not hold)."""
        flat, trained = self.owned.flat, {id(p) for _, p in self.named}
        buffers = dict(self.model.named_buffers())
        layout = {"version": 1, "params": [(n, tuple(p.shape)) for n, p in self.named], "n": flat.n,
                  "shard": flat.shard if self.owned.sharded else flat.n_pad, "sharded": self.owned.sharded,
                  "world_size": self.world_size, "fsdp": self.owned.fsdp is not None,  # FSDP2's slots per shard
                  "buffers": [(n, str(b.dtype).removeprefix("torch."), tuple(b.shape)) for n, b in buffers.items()],
                  "state_dict_keys": list(self.model.state_dict().keys()),
                  "aliases": adopt.aliases_of(self.model),  # tied weights: key -> the name that holds the tensor
                  "fixed": {n: p.detach().clone() for n, p in self.model.named_parameters(remove_duplicate=False)
                            if id(p) not in trained}}
        buf = io.BytesIO()
        torch.save(layout, buf)
        atomic_write_bytes(self.ctx.run_dir / "layout.pt", buf.getvalue())

    def _make_checkpoint_writer(self):
        if self.cfg.checkpoint_every <= 0:
            return None
        if not self.owned.sharded and self.rank != 0:
            return None  # replicated state: rank 0's copy is the checkpoint
        from unbroken.protect.tier2 import CheckpointWriter

        try:
            key = read_job_key(self.ctx.run_dir)  # the supervisor created it before starting us
        except JobKeyError as e:
            self._refuse(str(e))
        sharded = self.owned.sharded
        return CheckpointWriter(self.ctx.run_dir / "checkpoints", rank=self.rank if sharded else 0,
                                world_size=self.world_size if sharded else 1, run_id=self.ctx.run_dir.name,
                                strategy=self.cfg.strategy, key=key, keep=self.cfg.checkpoint_keep,
                                events=self.ctx.events)

    def _maybe_checkpoint(self, t: int) -> None:
        if self.ckpt is not None and t % self.cfg.checkpoint_every == 0:
            self.ctx.set_phase("checkpoint", t)
            self._point("checkpoint", t)
            self.ckpt.wait(self.ckpt.wait_timeout)  # the previous write lands (or its failure surfaces) first
            try:
                self._pin_common_step(t - self.cfg.checkpoint_every)
            finally:  # a failed vote keeps the older pin, which is still common: write step t anyway
                self.ckpt.save_async(t, self.gen.gen, self.owned.tensors(), {"strategy": self.cfg.strategy})

    def _pin_common_step(self, newest: int) -> None:
        """Pin the newest step (<= newest, within the last MASK_SLOTS slots) every writing rank
        committed: each ANDs its bitmask of committed slots with the others' (one tiny collective
        per checkpoint, on every sharded rank alike; a replica's only writer needs none)."""
        from unbroken.protect.tier2 import newest_in_mask, step_mask

        every = self.cfg.checkpoint_every
        if newest < 0:
            return  # nothing can be committed before the first checkpoint (the same t on every rank)
        mask = step_mask(self.ckpt.committed_steps(), newest, every)
        if self.owned.sharded and self.world_size > 1:
            agreed = torch.tensor([mask], dtype=torch.int64)
            self.comm.and_allreduce(agreed, what=f"tier-2 common step (<= {newest})")
            mask = int(agreed)
        common = newest_in_mask(mask, newest, every)
        if common is not None:
            self.ckpt.pin(common)
