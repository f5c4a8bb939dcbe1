"""The serving engine: the base model with batched LoRA slots, a FIFO queue with skip-ahead
admission (a request waits while every adapter slot is pinned), continuous batching (requests join
and leave the running batch at every iteration) and greedy decoding."""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from unbroken.models.data import ALPHABET, VOCAB_SIZE
from unbroken.models.gpt import build_model
from unbroken.serve.adapters import Adapter, RequestError, read_adapter
from unbroken.serve.cache import AdapterCache
from unbroken.serve.config import ServeConfig, base_model_id, lora_targets, serve_model
from unbroken.serve.lora import SlotTable, inject
from unbroken.serve.metrics import Metrics

_INDEX = {c: i for i, c in enumerate(ALPHABET)}
_ids = itertools.count()


@dataclass
class Request:
    adapter: str | None
    tokens: list[int]
    max_tokens: int
    on_done: Callable[["Request"], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    id: int = field(default_factory=lambda: next(_ids))
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each generated token was produced
    queued: float | None = None  # appended to the engine's queue (after the HTTP thread's hand-off)
    start: float | None = None  # admitted into the running batch
    slot: int = 0
    error: RequestError | None = None  # set when the request failed after it was queued

    @property
    def prompt_len(self) -> int:
        return len(self.tokens) - len(self.out)

    def text(self) -> str:
        return "".join(ALPHABET[t] for t in self.out)


def encode(prompt: str) -> list[int]:
    bad = sorted({c for c in prompt if c not in _INDEX})
    if bad:
        raise RequestError(f"prompt has characters outside the model's alphabet: {bad[:5]!r}; use printable ASCII")
    if not prompt:
        raise RequestError("prompt is empty: send at least one character")
    return [_INDEX[c] for c in prompt]


class Engine:
    """One server's model and scheduler. `submit` may be called from any thread; `step` (or
    `run_until` / `serve`) from one engine thread."""

    def __init__(self, cfg: ServeConfig, adapter_dir: Path) -> None:
        self.cfg, self.adapter_dir = cfg, Path(adapter_dir)
        self.model_cfg = serve_model()
        self.base = base_model_id(self.model_cfg, cfg.seed)
        self.table = SlotTable(lora_targets(self.model_cfg), cfg.slots, cfg.max_rank)
        self.model = inject(build_model(self.model_cfg, VOCAB_SIZE, cfg.seed).eval(), self.table)
        self.cache = AdapterCache(cfg.slots, self._load_slot)
        self.metrics = Metrics(cfg.starve_s)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._known: dict[str, int] = {}  # adapter -> rank, checked once on disk
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.iterations = 0
        self._logged = {"iterations": 0, "admissions": 0}  # ever logged: readers slice by these
        self._log_lock = threading.Lock()  # a log and its count change together
        self._busy_since = 0.0  # when the engine last went from idle to running
        # the recent iterations as (rows, padded length, largest rank, adapter loads, seconds, the
        # engine thread's CPU seconds, seconds since the engine was last idle) and admissions as
        # (arrival -> queued, idle engine's wake-up or None): what the twin's costs are fitted to
        # (GET /v1/iterations)
        self.iteration_log: deque[tuple[int, int, int, int, float, float, float]] = deque(maxlen=8192)
        self.admission_log: deque[tuple[float, float | None]] = deque(maxlen=8192)

    # -- requests --------------------------------------------------------------------------
    def check_adapter(self, name: str) -> int:
        if name not in self._known:
            self._known[name] = self._read(name).rank
        return self._known[name]

    def submit(self, req: Request) -> Request:
        """Queue a request or raise RequestError (the HTTP layer turns it into a 4xx)."""
        seq = self.model_cfg.seq_len
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {req.max_tokens!r}")
        if len(req.tokens) + req.max_tokens > seq:
            raise RequestError(f"prompt of {len(req.tokens)} + max_tokens {req.max_tokens} is longer than the "
                               f"context of {seq} tokens: shorten the prompt or lower max_tokens")
        if req.adapter is not None:
            self.check_adapter(req.adapter)
        with self._lock:
            if len(self.waiting) >= self.cfg.max_waiting:
                self.metrics.rejected += 1
                raise RequestError(f"server over its memory limit: {len(self.waiting)} requests queued "
                                   f"(max_waiting {self.cfg.max_waiting}); retry later or add servers", 429)
            req.queued = time.perf_counter()
            self.waiting.append(req)
        self._wake.set()
        return req

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration: admit what fits, decode one token for every running request. False if idle."""
        t0, cpu0, loads0, idle = time.perf_counter(), time.thread_time(), self.cache.loads, not self.running
        admitted = self._admit()
        if not self.running:
            return False
        if idle:
            self._busy_since = t0
        with self._log_lock:  # an idle engine's wake-up: from the request's queueing to this iteration's start
            self.admission_log.extend((r.queued - r.arrival, max(0.0, t0 - r.queued) if idle else None)
                                      for r in admitted)
            self._logged["admissions"] += len(admitted)
        batch = self.running
        lens = torch.tensor([len(r.tokens) for r in batch])
        idx = torch.zeros(len(batch), int(lens.max()), dtype=torch.long)
        for i, r in enumerate(batch):
            idx[i, :len(r.tokens)] = torch.tensor(r.tokens)
        self.table.use([r.slot for r in batch])
        with torch.inference_mode():
            logits = self.model(idx)
        nxt = logits[torch.arange(len(batch)), lens - 1].argmax(-1).tolist()
        now = time.perf_counter()
        self.iterations += 1
        keep, done = [], []
        for r, t in zip(batch, nxt):
            r.tokens.append(t)
            r.out.append(t)
            r.times.append(now)
            (keep if len(r.out) < r.max_tokens else done).append(r)
        # the step (admission, loads, forward), logged before the engine looks idle or any of its
        # requests is handed back: whoever saw either and then reads the log finds this iteration
        rec = (len(batch), int(lens.max()), self.table.rank, self.cache.loads - loads0,
               time.perf_counter() - t0, time.thread_time() - cpu0, t0 - self._busy_since)
        with self._log_lock:
            self.iteration_log.append(rec)
            self._logged["iterations"] += 1
        self.running = keep
        for r in done:
            self._finish(r)
        return True

    def logs(self) -> dict:
        """Both logs and how many records of each were ever logged, read together (GET /v1/iterations)."""
        with self._log_lock:
            return {"iterations": list(self.iteration_log), "admissions": list(self.admission_log),
                    "iterations_total": self._logged["iterations"], "admissions_total": self._logged["admissions"]}

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # a bug must not leave requests waiting for their timeout
                self._fail_running(RequestError(f"internal error in the engine: {type(e).__name__}: {e}", 500))
                continue
            if not busy:
                self._wake.wait(0.01)
                self._wake.clear()

    def _fail_running(self, err: RequestError) -> None:
        batch, self.running = self.running, []
        for r in batch:
            r.error = err
            self._finish(r)

    def run_until_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.perf_counter() + timeout_s
        while self.running or self.waiting:
            assert time.perf_counter() < deadline, f"engine still busy after {timeout_s}s"
            self.step()

    # -- internals -------------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        """Move what fits from the queue into the running batch; returns the requests admitted."""
        with self._lock:
            if not self.waiting or len(self.running) >= self.cfg.max_batch:
                return []
            still, admitted = deque(), []
            while self.waiting:
                r = self.waiting.popleft()
                slot = 0 if r.adapter is None else None
                if len(self.running) < self.cfg.max_batch and r.adapter is not None:
                    try:
                        slot = self.cache.acquire(r.adapter)
                    except RequestError as e:  # the adapter changed on disk since it was checked
                        r.error = e
                        self._finish(r)
                        continue
                if slot is None or len(self.running) >= self.cfg.max_batch:
                    still.append(r)
                    continue
                r.slot, r.start = slot, time.perf_counter()
                self.running.append(r)
                admitted.append(r)
            self.waiting = still
            return admitted

    def _finish(self, r: Request) -> None:
        if r.slot:
            self.cache.release(r.slot)
        if r.error is None:
            self.metrics.record(r)
        if r.on_done is not None:
            r.on_done(r)

    def _read(self, name: str) -> Adapter:
        return read_adapter(self.adapter_dir, name, model=self.model_cfg, base=self.base, max_rank=self.cfg.max_rank)

    def _load_slot(self, name: str, slot: int) -> None:
        self.table.put(slot, self._read(name))
