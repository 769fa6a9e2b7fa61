"""What the device check measures, at which sizes: one profile per platform (gpu, tpu) and the
tiny dry run that the test suite runs on a CPU (scripts/device_check.py).

A profile names the served model's shape (config.json; its weights are random, drawn on the
device: `--load-format dummy`), the burst the benchmark client sends, the kernels' shapes, the
compile-only target `jaxserve plan` predicts for, each stage's time limit, and the whole check's
budget. The model directory holds only config.json, generation_config.json and the embedded default
model's tokenizer (the real Qwen vocabulary): nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QWEN3_8B = json.loads((REPO / "scripts" / "model_configs" / "qwen3-8b.json").read_text())
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: tuple[int, int]   # drawn uniformly in [min, max] per request
    output_len: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class KernelShape:
    num_seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    max_context: int
    iters: int
    moe: tuple[int, int, int, int]   # grouped matmul: (tokens x top-k rows, experts, hidden, expert width)


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    platform: str                      # what the check expects jax to run on: "gpu" | "tpu" | "cpu"
    model: dict[str, Any]              # config.json of the served model
    features_layers: int               # the feature stage's model: the same widths, this many layers
    workload: Workload
    kernels: KernelShape
    interpret: bool                    # kernels in the Pallas interpreter (the CPU dry run)
    target: str                        # `jaxserve plan --target` of the prediction
    serve_args: tuple[str, ...]        # flags beyond the defaults (none on an accelerator: users' defaults)
    budget_s: float                    # the whole check
    limits: dict[str, float]           # stage -> its hard time limit, seconds
    # stage -> the least time it is started with (else SKIPPED): later stages keep these in reserve
    floors: dict[str, float]
    not_run: dict[str, str] = dataclasses.field(default_factory=dict)  # stage -> why this platform skips it

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Profile":
        return cls(**{**data, "workload": Workload(**data["workload"]), "kernels": KernelShape(**data["kernels"])})


STAGES = ("env", "kernels", "serve", "peer", "features")

_ACCELERATOR = dict(
    model=QWEN3_8B, features_layers=4,
    workload=Workload(256, (512, 1024), (128, 256)),
    kernels=KernelShape(num_seqs=64, q_heads=32, kv_heads=8, head_dim=128, page_size=16, max_context=2048,
                        iters=10, moe=(16384, 128, 2048, 768)),
    interpret=False, serve_args=(), budget_s=480.0,
    limits={"env": 45, "kernels": 90, "serve": 300, "peer": 120, "features": 150, "plan": 240},
    floors={"env": 10, "kernels": 30, "serve": 120, "peer": 60, "features": 60},
)

PROFILES: dict[str, Profile] = {
    "gpu": Profile(name="gpu", platform="gpu", target="gpu-h200:1x1x1", **_ACCELERATOR),
    # torch runs on a TPU only through torch_xla, which the tpu extra does not install
    "tpu": Profile(name="tpu", platform="tpu", target="tpu-v6e:1x1", **_ACCELERATOR,
                   not_run={"peer": "transformers needs torch_xla to run on a TPU (not installed)"}),
}


def dry_run(platform: str) -> Profile:
    """The same stages on this CPU at tiny sizes (the test suite's run): a 2-layer model of the
    default model's widths, 6 requests, kernels interpreted, a server of few buckets (its warm-up
    is most of the run); `platform` picks the kernels and the plan target the real run would use."""
    from jaxserve.default_model import CONFIG

    model = {**CONFIG, "num_hidden_layers": 2, "max_position_embeddings": 512, "dtype": "float32"}
    real = PROFILES[platform]
    return dataclasses.replace(
        real, name=f"{platform}-dry-run", platform="cpu", model=model, features_layers=2,
        workload=Workload(6, (16, 48), (4, 12)),
        kernels=KernelShape(num_seqs=4, q_heads=4, kv_heads=2, head_dim=32, page_size=4, max_context=64,
                            iters=1, moe=(64, 4, 32, 16)),
        interpret=True, serve_args=("--max-num-seqs", "8", "--max-num-batched-tokens", "64"), budget_s=600.0,
        limits={"env": 60, "kernels": 180, "serve": 240, "peer": 120, "features": 300, "plan": 300},
        floors={"env": 5, "kernels": 10, "serve": 30, "peer": 10, "features": 20})


def model_dir(model: dict[str, Any], dest: Path, layers: int | None = None) -> Path:
    """A HF model directory of config.json (with `layers` hidden layers when given) and the
    embedded default model's tokenizer and generation config; no weights (served with
    --load-format dummy)."""
    from jaxserve.default_model import ensure_default_model

    dest.mkdir(parents=True, exist_ok=True)
    source = ensure_default_model()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, dest / name)
    config = dict(model) if layers is None else {**model, "num_hidden_layers": layers}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
