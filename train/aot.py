"""Compile the train step for a TPU topology on a CPU-only machine and print per-chip HBM use.

    pip install "jax[tpu]"      # libtpu from PyPI; no TPU needed
    python -m train.aot --config train/configs/llama3_8b_v5p.yaml --topology v5p-8 --topology v5p-64 \
        train.global_batch_size=16

Each topology is ``<generation>:<shape>`` (v5p:2x2x2, v5e:4x4) or a slice name (v5p-8 = 4 chips,
v5p-64 = 32 chips; v5p/v4 slice names count TensorCores, 2 per chip). Exits with status 3 and the
numbers when the step does not fit a chip's HBM, 2 on a bad config.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu looks for a local TPU VM unless told its type; any value is fine for compile-only use.
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no exclusive TPU lock needed

from rag_jax.args import ScriptParser  # noqa: E402  (after the environment above: libtpu reads it when JAX loads)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__)
    parser.add_argument("--config", default=None, help="YAML preset (train/configs/*.yaml)")
    parser.add_argument("--topology", action="append", required=True, help="e.g. v5p:2x2x2, v5p-64 (repeatable)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    from rag_jax.train import aot
    from rag_jax.train.trainer import load_run_config
    try:
        cfg = load_run_config(args.config, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    status = 0
    for topology in args.topology:
        try:
            report = aot.aot_memory_report(cfg, topology)
        except aot.DoesNotFitError as e:
            print(f"DOES NOT FIT: {e}")
            status = 3
            continue
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(report.table())
    return status


if __name__ == "__main__":
    sys.exit(main())
