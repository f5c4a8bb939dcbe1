"""WattGPU's features: one numeric row per (GPU spec, model spec, operating point); NaN means missing.

Units: parameters in billions, bandwidth in GB/s, TFLOPS in 1e12 FLOP/s, so
2·params/bandwidth is the seconds to read the FP16 weights once and 2·params·batch/TFLOPS
is the seconds of FP16 compute per decode step at peak, each split over the serving GPUs.
Beyond WattGPU's set: the seconds to read the KV cache per step, the prefill compute per
output token, and their sum with the weights as a per-token roofline (`log_roofline_s`),
which the roofline-ratio target form divides out; and the serving framework one-hot
(`framework_is_<name>`) next to its code, as the nominal category it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from unbroken.predict.measurements import Measurement
from unbroken.predict.tables import MEMORY_TYPES, GpuSpec, ModelSpec

SCENARIOS = ("single", "offline", "server")
FRAMEWORKS = ("transformers", "vLLM", "TensorRT-LLM", "Deepspeed-MII", "Deepspeed", "llama.cpp", "sambaflow")

FEATURES = (
    "log_total_b_params", "log_active_b_params", "num_layers", "num_key_value_heads", "hidden_size",
    "num_experts", "experts_per_token",
    "memory_bandwidth_gb_s", "base_clock_mhz", "boost_clock_mhz", "boost_ratio", "tensor_tflops",
    "memory_size_gb", "memory_type", "release_year", "bandwidth_latency_s", "compute_latency_s",
    "log2_batch", "n_gpus", "scenario", "framework", "log_seq_tokens", "weights_per_gpu_gb",
    "log_kv_latency_s", "log_prefill_latency_s", "log_roofline_s",
) + tuple(f"framework_is_{f}" for f in FRAMEWORKS)
ROOFLINE = FEATURES.index("log_roofline_s")
# the columns the trees see: all but a mixture's expert counts, which the roofline uses (a decode step
# reads every expert some sequence routes to) and the trees do not: given them, the trees split on
# them elsewhere (LLM-Inference-Bench ITL LOGO 15.8% without, 17.5% with; docs/predict.md)
TREE_COLUMNS = [i for i, f in enumerate(FEATURES) if f not in ("num_experts", "experts_per_token")]
# the columns that are the GPU's own figures (the rest describe the model and the operating point,
# or derive from both: the latencies, recomputed by `with_gpu`)
GPU_COLUMNS = tuple(FEATURES.index(f) for f in (
    "memory_bandwidth_gb_s", "base_clock_mhz", "boost_clock_mhz", "boost_ratio", "tensor_tflops",
    "memory_size_gb", "memory_type", "release_year"))
_BW, _TF = FEATURES.index("memory_bandwidth_gb_s"), FEATURES.index("tensor_tflops")


@dataclass(frozen=True)
class OperatingPoint:
    """How a model is served: GPUs per replica, concurrent requests, tokens, scenario, framework."""

    n_gpus: int = 1
    batch: float = 1.0
    prompt_tokens: float = math.nan
    output_tokens: float = math.nan
    scenario: str = "server"
    framework: str = "vLLM"

    def __post_init__(self) -> None:
        if not (isinstance(self.n_gpus, int) and self.n_gpus >= 1):
            raise ValueError(f"n_gpus must be an integer >= 1, got {self.n_gpus!r}")
        if not self.batch > 0:
            raise ValueError(f"batch must be > 0, got {self.batch!r}")
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario {self.scenario!r} is not one of {', '.join(SCENARIOS)}")
        for name in ("prompt_tokens", "output_tokens"):
            if not (math.isnan(getattr(self, name)) or getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0 (or unknown), got {getattr(self, name)!r}")


def point_of(m: Measurement) -> OperatingPoint:
    return OperatingPoint(n_gpus=m.n_gpus, batch=m.batch, prompt_tokens=m.prompt_tokens,
                          output_tokens=m.output_tokens, scenario=m.scenario, framework=m.framework)


def _code(value: str, choices: tuple[str, ...]) -> float:
    return float(choices.index(value)) if value in choices else math.nan


def bandwidth_latency_s(gpu: GpuSpec, model: ModelSpec, n_gpus: int) -> float:
    """Seconds to stream the active FP16 weights once from memory, split over n_gpus."""
    return 2.0 * model.active_b_params / (gpu.memory_bandwidth_gb_s * n_gpus)


def compute_latency_s(gpu: GpuSpec, model: ModelSpec, n_gpus: int, batch: float) -> float:
    """Seconds of FP16 compute for one decode step of `batch` sequences at the dense tensor peak."""
    return 2.0 * model.active_b_params * 1e9 * batch / (gpu.tensor_tflops * 1e12 * n_gpus)


def kv_latency_s(gpu: GpuSpec, model: ModelSpec, op: OperatingPoint) -> float:
    """Seconds to read the FP16 KV cache once per decode step: K and V, every layer and KV head,
    `batch` sequences at their mean context (prompt + half the output; unknown lengths count 0)."""
    head_dim = model.hidden_size / model.num_attention_heads
    ctx = _known(op.prompt_tokens) + _known(op.output_tokens) / 2.0
    kv_bytes = 2.0 * model.num_layers * model.num_key_value_heads * head_dim * 2.0 * op.batch * ctx
    return kv_bytes / (gpu.memory_bandwidth_gb_s * 1e9 * op.n_gpus)


def prefill_latency_s(gpu: GpuSpec, model: ModelSpec, op: OperatingPoint) -> float:
    """Prefill compute at peak, spread over the output tokens (0 where the lengths are unknown):
    an end-to-end latency ÷ output length includes it."""
    out = _known(op.output_tokens)
    if out <= 0:
        return 0.0
    flops = 2.0 * model.active_b_params * 1e9 * op.batch * _known(op.prompt_tokens)
    return flops / (gpu.tensor_tflops * 1e12 * op.n_gpus) / out


def decode_read_b_params(total, active, experts, per_token, batch):
    """Billions of weights one decode step of `batch` sequences reads (numpy-broadcast): a dense
    model's active (= total) parameters; a mixture of `experts` routed experts, `per_token` per
    token, reads its shared weights and every expert some sequence routes to, on average (routing
    uniform and independent) experts × (1 − (1 − per_token/experts) ** batch) of them. Mixtral-8x7B
    reads 12.9 B at batch 1 and 46.2 of its 46.7 B at batch 16: at the batches served, its decode
    streams all its weights, not the active share (NaN experts: dense)."""
    total, active, experts, per_token, batch = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in
                                                                     (total, active, experts, per_token, batch)))
    moe = np.isfinite(experts) & (experts > per_token) & (total > active)
    with np.errstate(divide="ignore", invalid="ignore"):
        expert = (total - active) / (experts - per_token)  # one routed expert's weights
        touched = experts * (1.0 - (1.0 - per_token / experts) ** batch)
        read = active + expert * (touched - per_token)
    return np.where(moe, read, active)


def _read_factor(model: ModelSpec, batch: float) -> float:
    """Weights a decode step reads ÷ the active weights (1 for a dense model)."""
    return float(decode_read_b_params(model.total_b_params, model.active_b_params, model.num_experts,
                                      model.experts_per_token, batch)) / model.active_b_params


def roofline_s(gpu: GpuSpec, model: ModelSpec, op: OperatingPoint) -> float:
    """Per-token roofline: prefill share + max(weights and KV read, decode compute); NaN only where
    both the bandwidth and the TFLOPS are missing. The weights read are those the step touches
    (`decode_read_b_params`); WattGPU's bandwidth-latency feature keeps the active parameters."""
    weights = _read_factor(model, op.batch) * bandwidth_latency_s(gpu, model, op.n_gpus)
    read = weights + kv_latency_s(gpu, model, op)
    return prefill_latency_s(gpu, model, op) + float(np.fmax(read, compute_latency_s(gpu, model, op.n_gpus, op.batch)))


def framework_one_hot(framework: str) -> dict[str, float]:
    """One column per known framework, 1.0 for this one: a nominal category, so no tree split can
    group frameworks by their arbitrary order in FRAMEWORKS (the `framework` code column can).
    An unknown framework is missing (NaN in every column), not "none of them"."""
    known = framework in FRAMEWORKS
    return {f"framework_is_{f}": (float(f == framework) if known else math.nan) for f in FRAMEWORKS}


def _known(v: float) -> float:
    return 0.0 if math.isnan(v) else v


def _log(v: float) -> float:
    return math.log(v) if v > 0 else math.nan


def feature_row(gpu: GpuSpec, model: ModelSpec, op: OperatingPoint) -> list[float]:
    seq = (0.0 if math.isnan(op.prompt_tokens) else op.prompt_tokens) + \
          (0.0 if math.isnan(op.output_tokens) else op.output_tokens)
    values = {
        "log_total_b_params": math.log(model.total_b_params),
        "log_active_b_params": math.log(model.active_b_params),
        "num_layers": model.num_layers, "num_key_value_heads": model.num_key_value_heads,
        "hidden_size": model.hidden_size,
        "num_experts": model.num_experts, "experts_per_token": model.experts_per_token,
        "memory_bandwidth_gb_s": gpu.memory_bandwidth_gb_s, "base_clock_mhz": gpu.base_clock_mhz,
        "boost_clock_mhz": gpu.boost_clock_mhz, "boost_ratio": gpu.boost_clock_mhz / gpu.base_clock_mhz,
        "tensor_tflops": gpu.tensor_tflops, "memory_size_gb": gpu.memory_size_gb,
        "memory_type": _code(gpu.memory_type, MEMORY_TYPES), "release_year": gpu.release_year,
        "bandwidth_latency_s": bandwidth_latency_s(gpu, model, op.n_gpus),
        "compute_latency_s": compute_latency_s(gpu, model, op.n_gpus, op.batch),
        "log2_batch": math.log2(op.batch), "n_gpus": float(op.n_gpus),
        "scenario": _code(op.scenario, SCENARIOS), "framework": _code(op.framework, FRAMEWORKS),
        "log_seq_tokens": math.log(seq) if seq > 0 else math.nan,
        "weights_per_gpu_gb": 2.0 * model.total_b_params / op.n_gpus,
        "log_kv_latency_s": _log(kv_latency_s(gpu, model, op)),
        "log_prefill_latency_s": _log(prefill_latency_s(gpu, model, op)),
        "log_roofline_s": _log(roofline_s(gpu, model, op)),
        **framework_one_hot(op.framework),
    }
    return [float(values[f]) for f in FEATURES]


def with_gpu(X: np.ndarray, gpu_figures: np.ndarray) -> np.ndarray:
    """The feature rows `X` as they would read on another GPU whose GPU_COLUMNS values are
    `gpu_figures`: its figures copied in, the latencies rescaled by the bandwidth and TFLOPS
    ratios and the roofline recomputed (equal to `matrix` on that GPU; tested). Both GPUs need a
    bandwidth and a TFLOPS figure: NaN rows otherwise."""
    out = X.copy()
    out[:, GPU_COLUMNS] = gpu_figures
    bw, tf = X[:, _BW] / out[:, _BW], X[:, _TF] / out[:, _TF]  # old / new: a latency scales by it
    i = FEATURES.index
    out[:, i("bandwidth_latency_s")] *= bw
    out[:, i("compute_latency_s")] *= tf
    out[:, i("log_kv_latency_s")] += np.log(bw)
    out[:, i("log_prefill_latency_s")] += np.log(tf)
    _recompute_roofline(out)
    out[~(np.isfinite(bw) & np.isfinite(tf))] = np.nan
    return out


def with_batch(X: np.ndarray, log2_batch: float | np.ndarray) -> np.ndarray:
    """The feature rows `X` at another batch (log2): the batch column, the decode compute, KV read
    and prefill latencies (each proportional to the batch) and the roofline (equal to `matrix` at
    that batch; tested)."""
    out = X.copy()
    i = FEATURES.index
    scale = np.exp2(log2_batch - X[:, i("log2_batch")])
    out[:, i("log2_batch")] = log2_batch
    out[:, i("compute_latency_s")] *= scale
    out[:, i("log_kv_latency_s")] += np.log(scale)
    out[:, i("log_prefill_latency_s")] += np.log(scale)
    _recompute_roofline(out)
    return out


def _recompute_roofline(X: np.ndarray) -> None:
    """`X`'s roofline column from its latency columns, in place (`roofline_s`)."""
    i = FEATURES.index
    kv, prefill = (np.nan_to_num(np.exp(X[:, i(c)])) for c in ("log_kv_latency_s", "log_prefill_latency_s"))
    factor = decode_read_b_params(*(np.exp(X[:, i(c)]) for c in ("log_total_b_params", "log_active_b_params")),
                                  X[:, i("num_experts")], X[:, i("experts_per_token")],
                                  np.exp2(X[:, i("log2_batch")])) / np.exp(X[:, i("log_active_b_params")])
    read = factor * X[:, i("bandwidth_latency_s")] + kv
    X[:, ROOFLINE] = np.log(prefill + np.fmax(read, X[:, i("compute_latency_s")]))


def matrix(rows: list[tuple[GpuSpec, ModelSpec, OperatingPoint]]) -> np.ndarray:
    """Feature matrix (n, len(FEATURES)), float64, NaN for missing figures."""
    if not rows:
        return np.empty((0, len(FEATURES)))
    return np.array([feature_row(g, m, op) for g, m, op in rows], dtype=np.float64)
