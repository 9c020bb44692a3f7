"""Run a training job as N processes on this machine (CPU devices, gloo collectives over 127.0.0.1).

    python -m train.launch_local --processes 2 --devices_per_process 2 -- \
        --config train/configs/tiny.yaml data.data_dir=runs/tfds train.run_dir=runs/local

This is how the multi-host tests run; it exercises jax.distributed, per-host data sharding and multi-process
orbax checkpoints without a cluster. SIGTERM/SIGINT/SIGHUP are forwarded to the children, and no child
outlives the launcher (``rag_jax.distributed.launch_local``). A failed job prints the error (each process's
exit code and stderr tail) and exits 1.
"""
from __future__ import annotations

import argparse
import sys

from rag_jax import distributed
from rag_jax.args import ScriptParser


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=2)
    parser.add_argument("--timeout_s", type=float, default=3600.0)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of python -m train.train (after --)")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        results = distributed.launch_local([sys.executable, "-m", "train.train", *train_args], args.processes,
                                           args.devices_per_process, args.timeout_s)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, r in enumerate(results):
        print(f"--- process {i} ---\n{r.stdout}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
