"""Public measurements in one schema: ML.ENERGY v2, ML.ENERGY 2023 (legacy), LLM-Inference-Bench.

One `Measurement` per measured configuration: which GPU (spec-table name) and model, how
many GPUs served it, batch size, tokens, scenario and framework, and the targets: mean
power per GPU (W, NaN where not measured) and inter-token latency (s per output token).

ML.ENERGY reports energy per request, not power. Power follows from

    P_total (W) = energy/request (J) / output tokens per request * token throughput (tok/s)

(J/request ÷ tok/request = J/tok; × tok/s = J/s), which is the draw of all TP×PP GPUs
together; per GPU we divide by TP×PP.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from unbroken.predict.tables import DATA

V2 = DATA / "ml-energy" / "llm_text_generation_v2.csv"
LEGACY = DATA / "ml-energy" / "legacy"
BENCH = DATA / "llm-inference-bench" / "All_results.csv"
DATASETS = ("ml-energy", "ml-energy-legacy", "llm-inference-bench")

# labels in the data sets -> spec-table names (assumptions stated in docs/predict.md)
DATASET_GPUS = {
    "NVIDIA A100-SXM4-40GB": "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3": "NVIDIA H100 SXM5 80GB",
    "A100": "NVIDIA A100-SXM4-40GB", "A40": "NVIDIA A40", "V100": "Tesla V100-SXM2-32GB",
    "Nvidia A100 GPU": "NVIDIA A100-SXM4-40GB", "Nvidia H100 GPU": "NVIDIA H100 SXM5 80GB",
    "Nvidia GH200 GPU": "NVIDIA GH200 (H100 96GB)", "AMD MI250 GPU": "AMD Instinct MI250",
    "AMD MI300X GPU": "AMD Instinct MI300X", "Intel Max 1550": "Intel Data Center GPU Max 1550",
    "Intel PVC GPU": "Intel Data Center GPU Max 1550", "Habana Gaudi2": "Intel Gaudi2",
    "SambaNova SN40L": "SambaNova SN40L",
}


@dataclass(frozen=True)
class Measurement:
    dataset: str
    gpu: str          # spec-table name
    model: str        # as the data set names it
    n_gpus: int       # GPUs serving one replica (TP x PP)
    batch: float      # concurrent requests (average where the data set reports one)
    prompt_tokens: float
    output_tokens: float
    scenario: str     # "server" (continuous batching), "offline" (fixed batch), "single" (one request)
    framework: str
    power_w: float    # mean power per GPU, NaN if not measured
    itl_s: float      # seconds per output token
    source: str = ""

    def __post_init__(self) -> None:
        if self.n_gpus < 1 or not self.batch > 0 or not self.itl_s > 0:
            raise ValueError(f"bad measurement row {self.source}: n_gpus={self.n_gpus}, batch={self.batch}, "
                             f"itl_s={self.itl_s} must all be positive")


def power_from_energy(energy_per_request_j: float, output_tokens: float, throughput_tok_s: float,
                      n_gpus: int = 1) -> float:
    """Mean power per GPU (W) from ML.ENERGY's energy/request, output tokens/request and token throughput."""
    return energy_per_request_j / output_tokens * throughput_tok_s / n_gpus


def load_ml_energy_v2(path: Path = V2) -> list[Measurement]:
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            n = int(r["TP"]) * int(r["PP"])
            out_tok = float(r["Avg Output Tokens"])
            out.append(Measurement(
                dataset="ml-energy", gpu=DATASET_GPUS[r["GPU"]], model=r["Model"], n_gpus=n,
                batch=float(r["Avg BS (reqs)"]), prompt_tokens=math.nan, output_tokens=out_tok, scenario="server",
                framework="vLLM", power_w=power_from_energy(float(r["Energy/req (J)"]), out_tok,
                                                            float(r["Token tput (tok/s)"]), n),
                itl_s=float(r["Avg TPOT (s)"]), source=r["source_file"]))
    return out


def load_ml_energy_legacy(folder: Path = LEGACY) -> list[Measurement]:
    """2023 runs, one request at a time on one GPU: ITL = latency / response length."""
    out = []
    for path in sorted(folder.glob("*_benchmark.csv")):
        gpu_label, task = path.name.split("_")[0], path.name.split("_")[1]
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                out_tok = float(r["response_length"])
                out.append(Measurement(
                    dataset="ml-energy-legacy", gpu=DATASET_GPUS[gpu_label], model=r["model"], n_gpus=1, batch=1.0,
                    prompt_tokens=math.nan, output_tokens=out_tok, scenario="single", framework="transformers",
                    power_w=power_from_energy(float(r["energy"]), out_tok, float(r["throughput"])),
                    itl_s=float(r["latency"]) / out_tok, source=f"{path.name}:{task}:{r['model']}"))
    return out


def load_llm_inference_bench(path: Path = BENCH) -> list[Measurement]:
    """Argonne's runs use input length = output length = L; Latency is the whole batch's end-to-end
    time, so ITL here is latency / L (prefill included, which is small next to L decode steps)."""
    out = []
    with open(path, newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            length = float(r["Input Output Length"])
            out.append(Measurement(
                dataset="llm-inference-bench", gpu=DATASET_GPUS[r["Hardware"]], model=r["Model"],
                n_gpus=int(r["Num of Hardware"]), batch=float(r["Batch Size"]), prompt_tokens=length,
                output_tokens=length, scenario="offline", framework=r["Framework"], power_w=math.nan,
                itl_s=float(r["Latency"]) / length, source=f"All_results.csv:{i + 2}"))
    return out


def load(dataset: str) -> list[Measurement]:
    loaders = {"ml-energy": load_ml_energy_v2, "ml-energy-legacy": load_ml_energy_legacy,
               "llm-inference-bench": load_llm_inference_bench}
    if dataset not in loaders:
        raise ValueError(f"unknown data set {dataset!r}; choose one of {', '.join(DATASETS)}")
    return loaders[dataset]()


def load_user(path: Path) -> list[Measurement]:
    """Measurements a user collected with `unbroken predict profile` (JSONL, one Measurement per line)."""
    names = {f.name for f in fields(Measurement)}
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(Measurement(**{k: (math.nan if v is None else v) for k, v in d.items() if k in names}))
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{n} is not a measurement line ({e}); write them with "
                                 f"`unbroken predict profile` (fields: {', '.join(sorted(names))})") from None
    return out


def to_json_line(m: Measurement) -> str:
    return json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(m).items()})
