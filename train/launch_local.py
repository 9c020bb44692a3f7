"""Run a training job as N processes on this machine (CPU devices, gloo collectives over 127.0.0.1).

    python -m train.launch_local --processes 2 --devices_per_process 2 -- \
        --config train/configs/tiny.yaml data.data_dir=runs/tfds train.run_dir=runs/local

This is how the multi-host tests run; it exercises jax.distributed, per-host data sharding and multi-process
orbax checkpoints without a cluster.
"""
from __future__ import annotations

import argparse
import sys

from rag_jax import distributed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=2)
    parser.add_argument("--timeout_s", type=float, default=3600.0)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of python -m train.train (after --)")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    results = distributed.launch_local([sys.executable, "-m", "train.train", *train_args], args.processes,
                                       args.devices_per_process, args.timeout_s)
    for i, r in enumerate(results):
        print(f"--- process {i} ---\n{r.stdout}", end="")


if __name__ == "__main__":
    main()
