"""Parallel strategies over one flat parameter buffer: DDP (replicated) and ZeRO-1 (sharded optimizer)."""
