"""The spec tables: GPUs (WattGPU's TechPowerUp table + datasheet rows) and LLMs, name lookup, unit checks.

Every figure keeps its unit in its column name; a value outside the physically possible
range for that unit is rejected (a bandwidth of 3.35 "GB/s" was meant as TB/s). Missing
figures stay NaN: the regressors see them as missing, never as zero.
"""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
WATTGPU_GPUS = DATA / "wattgpu" / "gpu_features.csv"
EXTRA_GPUS = DATA / "gpu_specs_extra.csv"
WATTGPU_MODELS = DATA / "wattgpu" / "model_features.csv"
EXTRA_MODELS = DATA / "model_specs_extra.csv"

# short names for WattGPU rows (the data sets and users say "A100", "V100")
WATTGPU_ALIASES = {"A100": "NVIDIA A100-SXM4-40GB", "A100 SXM4": "NVIDIA A100-SXM4-40GB",
                   "A100-SXM4-40GB": "NVIDIA A100-SXM4-40GB", "V100": "Tesla V100-SXM2-32GB",
                   "V100 SXM2": "Tesla V100-SXM2-32GB", "H200 NVL": "NVIDIA H200", "RTX 4090": "NVIDIA GeForce RTX 4090",
                   "RTX 3090": "NVIDIA GeForce RTX 3090"}
MEMORY_TYPES = ("GDDR6", "GDDR6X", "HBM", "HBM2", "HBM2e", "HBM3", "HBM3e")  # ordinal: older/slower first

# column -> (lowest, highest) physically plausible value in that column's unit
GPU_RANGES = {
    "base_clock_mhz": (100.0, 5000.0), "boost_clock_mhz": (100.0, 5000.0),
    "memory_size_gb": (1.0, 2048.0), "memory_bandwidth_gb_s": (50.0, 50000.0),
    "thermal_design_power_w": (10.0, 3000.0), "tensor_tflops": (1.0, 50000.0),
    "release_year": (2000.0, 2100.0),
}
MODEL_RANGES = {
    "total_b_params": (1e-5, 10000.0), "active_b_params": (1e-5, 10000.0), "num_layers": (1.0, 1000.0),
    "hidden_size": (64.0, 131072.0), "num_attention_heads": (1.0, 1024.0), "num_key_value_heads": (1.0, 1024.0),
}


class SpecError(ValueError):
    """A spec table or a lookup the user asked for is wrong; the message says how to fix it."""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    base_clock_mhz: float
    boost_clock_mhz: float
    memory_size_gb: float
    memory_bandwidth_gb_s: float
    memory_type: str
    thermal_design_power_w: float
    tensor_tflops: float  # dense FP16/BF16 tensor peak
    release_year: float
    source: str = ""
    # whose part it is ("NVIDIA", "AMD", "Intel", "Intel Habana", ...): its software stack follows
    # it, so an unmeasured GPU's ITL is transferred from a measured part of the same manufacturer
    manufacturer: str = ""

    def __post_init__(self) -> None:
        check_units(self.name, {k: getattr(self, k) for k in GPU_RANGES}, GPU_RANGES)
        if self.memory_type and self.memory_type not in MEMORY_TYPES:
            raise SpecError(f"GPU {self.name!r}: memory_type {self.memory_type!r} is not one of {', '.join(MEMORY_TYPES)}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_b_params: float
    active_b_params: float
    num_layers: float
    hidden_size: float
    num_attention_heads: float
    num_key_value_heads: float
    source: str = ""
    # a mixture of experts: its routed experts and how many each token uses (NaN: a dense model);
    # a decode step of a batch reads every expert some token routes to (`features.decode_read_b_params`)
    num_experts: float = math.nan
    experts_per_token: float = math.nan

    def __post_init__(self) -> None:
        check_units(self.name, {k: getattr(self, k) for k in MODEL_RANGES}, MODEL_RANGES)
        if not math.isnan(self.active_b_params) and self.active_b_params > self.total_b_params * 1.001:
            raise SpecError(f"model {self.name!r}: active_b_params {self.active_b_params} exceeds total_b_params "
                            f"{self.total_b_params}; active parameters are a subset of the total")
        experts = (self.num_experts, self.experts_per_token)
        if any(math.isnan(v) for v in experts) and not all(math.isnan(v) for v in experts):
            raise SpecError(f"model {self.name!r}: give num_experts and experts_per_token together (a mixture of "
                            f"experts) or neither (a dense model), got {experts[0]!r} and {experts[1]!r}")
        if not math.isnan(self.num_experts) and not 1 <= self.experts_per_token <= self.num_experts <= 4096:
            raise SpecError(f"model {self.name!r}: experts_per_token {self.experts_per_token:g} must be at least 1 and "
                            f"at most num_experts {self.num_experts:g} (at most 4096): each token routes to some "
                            f"of the experts")


def check_units(name: str, values: dict[str, float], ranges: dict[str, tuple[float, float]]) -> None:
    for col, v in values.items():
        lo, hi = ranges[col]
        if not math.isnan(v) and not lo <= v <= hi:
            raise SpecError(f"{name!r}: {col}={v:g} is outside {lo:g}..{hi:g} for that unit "
                            f"(check the unit: the column name says it)")


def _num(s: str | None) -> float:
    s = (s or "").strip()
    if s in ("", "N/A", "NaN", "nan", "None"):
        return math.nan
    try:
        return float(s)
    except ValueError:
        raise SpecError(f"{s!r} is not a number") from None


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter=";"))


def _spec_rows(path: Path, name_column: str, template: Path) -> list[dict[str, str]]:
    """The rows of a user's (or our) spec file, after checking it exists and is keyed by `name_column`."""
    if not path.is_file():
        raise SpecError(f"spec file {path} does not exist; pass a ';'-separated CSV like {template.name}")
    rows = _rows(path)
    if rows and name_column not in rows[0]:
        raise SpecError(f"{path} has no {name_column} column; use the header of {template}")
    return rows


def key(name: str) -> str:
    """Lookup key: case, spaces, dashes, vendor words and 'GPU' do not matter."""
    s = name.lower()
    for word in ("nvidia", "tesla", "amd", "instinct", "intel", "habana", "gpu", "data center"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


def model_key(name: str) -> str:
    """Model lookup key: organisation, case, 'Meta-' and chat/instruct suffixes do not matter
    (a fine-tune has its base model's architecture)."""
    s = name.split("/")[-1].lower()
    s = re.sub(r"^meta-", "", s)
    while True:
        t = re.sub(r"[-_](instruct|chat|hf|it|base)$", "", s)
        if t == s:
            break
        s = t
    return re.sub(r"[^a-z0-9.]", "", s)


def _gpu_from_row(r: dict[str, str], name: str, source: str) -> GpuSpec:
    return GpuSpec(name=name, base_clock_mhz=_num(r.get("base_clock_mhz")),
                   boost_clock_mhz=_num(r.get("boost_clock_mhz")), memory_size_gb=_num(r.get("memory_size_gb")),
                   memory_bandwidth_gb_s=_num(r.get("memory_bandwidth_gb_s")),
                   memory_type=(r.get("memory_type") or "").strip(),
                   thermal_design_power_w=_num(r.get("thermal_design_power_w")),
                   tensor_tflops=_num(r.get("tensor_tflops")), release_year=_num(r.get("release_year")), source=source,
                   manufacturer=(r.get("manufacturer") or "").strip())


@dataclass(frozen=True)
class GpuTable:
    specs: tuple[GpuSpec, ...]
    aliases: dict  # key(alias) -> spec name
    files: tuple[str, ...]

    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def get(self, name: str) -> GpuSpec:
        by_name = {s.name: s for s in self.specs}
        hit = self.aliases.get(key(name))
        if hit is None:
            raise SpecError(f"GPU {name!r} is not in the spec tables ({', '.join(self.files)}); known: "
                            f"{', '.join(self.names())}. Add a row with its datasheet figures to a CSV in the "
                            f"gpu_specs_extra.csv format and pass it with --gpu-specs FILE")
        return by_name[hit]


def load_gpus(extra: tuple[Path, ...] = ()) -> GpuTable:
    """WattGPU's table, then our datasheet rows, then the user's files (later rows win on a name clash)."""
    specs: dict[str, GpuSpec] = {}
    aliases: dict[str, str] = {}
    for r in _rows(WATTGPU_GPUS):
        name = r["gpu_type"].strip()
        specs[name] = _gpu_from_row(r, name, f"TechPowerUp via WattGPU ({r.get('tpu_url', '')})")
        for a in (name, r.get("gpu_db_name", ""), r.get("gpu_db_name", "").replace(" PCIe", "")):
            if a:
                aliases[key(a)] = name
    for a, name in WATTGPU_ALIASES.items():
        aliases[key(a)] = name
    files = [WATTGPU_GPUS.name]
    for path in (EXTRA_GPUS, *extra):
        for r in _spec_rows(Path(path), "gpu_type", EXTRA_GPUS):
            name = r["gpu_type"].strip()
            specs[name] = _gpu_from_row(r, name, (r.get("source") or str(path)).strip())
            for a in [name, *(r.get("aliases") or "").split("|")]:
                if a.strip():
                    aliases[key(a)] = name
        files.append(Path(path).name)
    return GpuTable(specs=tuple(specs.values()), aliases=aliases, files=tuple(files))


@dataclass(frozen=True)
class ModelTable:
    specs: tuple[ModelSpec, ...]
    files: tuple[str, ...]

    def get(self, name: str) -> ModelSpec:
        exact = {s.name.lower(): s for s in self.specs}
        if name.lower() in exact:
            return exact[name.lower()]
        loose = {model_key(s.name): s for s in self.specs}
        if model_key(name) in loose:
            return loose[model_key(name)]
        raise SpecError(f"model {name!r} is not in the model tables ({', '.join(self.files)}). Add a row "
                        f"(total/active parameters in billions, layers, hidden size, heads, KV heads and, for a "
                        f"mixture of experts, its expert counts, from its config.json) to a CSV in the "
                        f"model_specs_extra.csv format and pass it with --model-specs FILE")


# the config.json fields that name a mixture's routed experts and the experts per token, by family
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_PER_TOKEN = ("experts_per_token", "num_experts_per_tok")


def _first_number(r: dict[str, str], columns: tuple[str, ...]) -> float:
    return next((v for v in (_num(r.get(c)) for c in columns) if not math.isnan(v)), math.nan)


def _model_from_row(r: dict[str, str], source: str) -> ModelSpec:
    total = _num(r.get("total_b_params"))
    active = _num(r.get("active_b_params"))
    experts, per_token = _first_number(r, _EXPERTS), _first_number(r, _PER_TOKEN)
    if not experts > 1:  # one expert, or none named: a dense model
        experts = per_token = math.nan
    return ModelSpec(name=r["model_name"].strip(), total_b_params=total,
                     active_b_params=total if math.isnan(active) else active,
                     num_layers=_num(r.get("num_layers")), hidden_size=_num(r.get("hidden_size")),
                     num_attention_heads=_num(r.get("num_attention_heads")),
                     num_key_value_heads=_num(r.get("num_key_value_heads")), source=source,
                     num_experts=experts, experts_per_token=per_token)


def config_row(name: str) -> dict[str, str] | None:
    """The WattGPU table's whole row (its config.json fields) for model `name`, or None where it has none."""
    for r in _rows(WATTGPU_MODELS):
        if model_key(r["model_name"]) == model_key(name) and (r.get("model_type") or "").strip():
            return r
    return None


def load_models(extra: tuple[Path, ...] = ()) -> ModelTable:
    specs: dict[str, ModelSpec] = {}
    for r in _rows(WATTGPU_MODELS):
        s = _model_from_row(r, "Hugging Face config via WattGPU")
        specs[s.name] = s
    files = [WATTGPU_MODELS.name]
    for path in (EXTRA_MODELS, *extra):
        for r in _spec_rows(Path(path), "model_name", EXTRA_MODELS):
            s = _model_from_row(r, (r.get("source") or str(path)).strip())
            specs[s.name] = s
        files.append(Path(path).name)
    return ModelTable(specs=tuple(specs.values()), files=tuple(files))
