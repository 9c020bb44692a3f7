"""Observability: model FLOPs per token, MFU, and metric writers (JSONL, TensorBoard via tensorboardX, tqdm).

FLOPs count matmuls only (PaLM, Chowdhery et al. 2022, appendix B): training = 3x forward
(forward + backward), forward = 2 FLOPs per multiply-add. Per token: ``6 * N_matmul`` for the weight
matmuls (q/k/v/o, SwiGLU, LM head; not the embedding gather) plus attention scores and values,
``6 * num_layers * seq_len * num_heads * head_dim`` when causal (half of the full ``12 * ...``, as
MaxText counts it since its PR #1988; research note jax_frameworks.md section 5). Rematerialization
does not change model FLOPs (MFU counts useful work only).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from rag_jax.atomic import write_text
from rag_jax.model import ModelConfig
from rag_jax.model.transformer import REMAT_NAMES

# Dense bf16 peak FLOP/s per chip (vendor data sheets; research note jax_frameworks.md section 5).
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12,
}


def matmul_params(cfg: ModelConfig) -> int:
    """Weights used in matmuls per forward token: attention + MLP per layer, plus the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + h * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs of one training step (forward + backward) per token at ``seq_len`` tokens per row."""
    attention = 12 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
    return 6.0 * matmul_params(cfg) + (attention / 2 if causal else attention)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, remat_policy: str) -> float:
    """FLOPs per token the backward spends recomputing forward work under ``remat_policy``
    (``model.transformer.REMAT_POLICIES``): what the policy does not save of each layer's forward, i.e. all of
    it (``full``), the batched attention products (``dots`` saves only matmuls without batch dimensions), or
    everything but the named projections; causal attention counted at half, as ``train_flops_per_token``.
    Model FLOPs plus this is the hardware work of a step."""
    h, hd, m = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    parts = {"qkv_proj": 2 * h * hd * (cfg.num_heads + 2 * cfg.num_kv_heads), "out_proj": 2 * cfg.num_heads * hd * h,
             "mlpwi": 4 * h * m, "down": 2 * m * h, "attention": 2 * seq_len * cfg.num_heads * hd}
    if remat_policy == "none":
        return 0.0
    if remat_policy == "dots":
        kept = ("qkv_proj", "out_proj", "mlpwi", "down")
    elif remat_policy == "full":
        kept = ()
    else:
        kept = REMAT_NAMES[remat_policy]
    return float(cfg.num_layers * sum(v for k, v in parts.items() if k not in kept))


def peak_flops_per_device(device: jax.Device | None = None, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device: ``override`` if given, else looked up by ``device_kind``, else None."""
    if override:
        return float(override)
    kind = (device or jax.devices()[0]).device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak_per_device: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1], or None when the peak is unknown."""
    if not peak_per_device:
        return None
    return tokens_per_s * flops_per_token / (num_devices * peak_per_device)


class MetricWriter:
    """Writes scalar metrics to ``<dir>/metrics.jsonl`` and TensorBoard event files on process 0 only.

    ``from_step``: the step the run starts from. Rows of a previous attempt after it (a run killed after
    logging, resumed from an earlier checkpoint) are dropped, so the file holds one curve; ``from_step=0``
    starts a new file. :meth:`history` returns the rows with a prefix, earlier attempts' included.
    """

    def __init__(self, log_dir: str | Path | None, *, jsonl: bool = True, tensorboard: bool = True,
                 from_step: int = 0):
        self.enabled = log_dir is not None and jax.process_index() == 0
        self._jsonl = self._tb = None
        self._rows: list[dict] = []
        if not self.enabled:
            return
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "metrics.jsonl"
        if path.is_file():
            self._rows = [r for r in read_jsonl(path) if from_step and r.get("step", 0) <= from_step]
        if jsonl:
            write_text(path, "".join(json.dumps(r) + "\n" for r in self._rows))
            self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(log_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{f"{prefix}{k}": (float(v) if v is not None else None) for k, v in metrics.items()}}
        self._rows.append(row)
        if self._jsonl:
            self._jsonl.write(json.dumps(row) + "\n")
        if self._tb:
            for k, v in row.items():
                if v is not None and k != "step":
                    self._tb.add_scalar(k, v, int(step))

    def history(self, prefix: str) -> list[dict]:
        """Rows holding keys with ``prefix``, as ``{"step", <key without prefix>: value, ...}`` (process 0)."""
        out = []
        for r in self._rows:
            keys = {k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)}
            if keys:
                out.append({"step": r["step"], **keys})
        return out

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
