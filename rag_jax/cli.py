"""``rag-jax`` command line: ``rag-jax smoke`` (tiny end-to-end check) and the main jobs.

Errors in user input print one line (``rag-jax: error: ...``) and exit with status 2.
"""
from __future__ import annotations

import argparse
import sys
import time


def _smoke(args) -> int:
    from flax import nnx

    from rag_jax.data.phantom import generate_universe
    from rag_jax.data.tokenizer import train_bpe
    from rag_jax.inference.generate import generate
    from rag_jax.model import ModelConfig, Transformer

    t0 = time.perf_counter()
    universe = generate_universe(num_people=args.people, seed=args.seed)
    texts = [a["article"] for a in universe.articles]
    tok = train_bpe(texts, vocab_size=args.vocab_size)
    cfg = ModelConfig.tiny(vocab_size=tok.get_vocab_size())
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    prompt = tok.encode(universe.questions[0]["question"]).ids
    out = generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=0.0)
    print(f"universe: {len(universe.articles)} articles, {len(universe.questions)} questions")
    print(f"tokenizer: {tok.get_vocab_size()} tokens; model: {cfg.num_layers} layers, hidden {cfg.hidden_size}")
    print(f"prompt: {universe.questions[0]['question']!r}")
    print(f"generated {out.shape[1]} tokens (untrained model): {out[0].tolist()}")
    print(f"smoke run ok in {time.perf_counter() - t0:.1f} s")
    return 0


def _demo(args) -> int:
    from rag_jax.demo import run_cli
    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rag-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="generate data, train a tokenizer, build a tiny model, generate tokens")
    smoke.add_argument("--people", type=int, default=50)
    smoke.add_argument("--vocab-size", type=int, default=600)
    smoke.add_argument("--max-new-tokens", type=int, default=16)
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=_smoke)
    demo = sub.add_parser(
        "demo", help="the main job: universe -> reader base -> GRIT + Block-Attention fine-tuning -> ScaNN retrieval "
        "-> answers, TTFT, plots, metrics JSON, checkpoint (rag_jax/demo.py)",
        description="Train and evaluate a small retrieval-augmented model end to end (see rag_jax/demo.py). "
        "Default: a few minutes on 2 CPU cores.")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                      help="config overrides, e.g. train.steps=400 task.num_passages=3")
    demo.add_argument("--config", default=None, help="YAML config (e.g. train/configs/demo_gpu.yaml)")
    demo.add_argument("--data", default=None,
                      help="PhantomWiki-format folder (articles.json + questions.json) instead of generated universes")
    demo.add_argument("--out", default="runs/demo", help="output folder (report, plots, checkpoint)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)
    from rag_jax.inference.chat import add_subcommands
    add_subcommands(sub)  # chat, generate, convert
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"rag-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
