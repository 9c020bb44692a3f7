"""``rag-jax train``: train a model with the one trainer (``rag_jax.train.trainer.run``) from a YAML preset.

    rag-jax train --config train/configs/tiny.yaml [key=value ...]     # = python -m train.train ...

Multi-host: every process runs the same command; the coordinator comes from the environment
(RAG_JAX_COORDINATOR / RAG_JAX_NUM_PROCESSES / RAG_JAX_PROCESS_ID, see rag_jax.distributed) or is
auto-detected on Cloud TPU and SLURM (``--auto_distributed``). See train/launch_*.sh.
"""
from __future__ import annotations

import logging
import sys

from rag_jax import distributed
from rag_jax.args import ScriptParser
from rag_jax.train import trainer


def main(argv: list[str] | None = None) -> int:
    """Train; 0 when done, 2 (one-line ``error: ...`` on stderr) for a bad config or missing input."""
    try:
        train(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def train(argv: list[str] | None = None):
    """Parse ``argv``, train, print the final losses; returns the ``TrainResult``."""
    parser = ScriptParser(prog="rag-jax train", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML preset (train/configs/*.yaml)")
    parser.add_argument("--auto_distributed", action="store_true",
                        help="call jax.distributed.initialize() with no arguments (Cloud TPU pods, SLURM)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100 mesh.fsdp=-1")
    args = parser.parse_args(argv)
    # force: importing the libraries (tfds, orbax, ...) already gave the root logger a handler at WARNING
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    cfg = trainer.load_run_config(args.config, args.overrides)
    if args.auto_distributed:
        distributed.initialize_from_cluster()
    else:
        distributed.initialize()
    result = trainer.run(cfg)
    evals = result["eval"]
    print(f"done: step {result['step']} train_loss {result['train_loss']:.4f}"
          + (f" eval_loss {evals[-1][1]['loss']:.4f}" if evals else ""), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
