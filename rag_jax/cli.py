"""``rag-jax`` command line: the main jobs, evaluations and benchmarks (``python -m rag_jax`` is the same).

    rag-jax train --config train/configs/tiny.yaml [key=value ...]   train a model (rag_jax.train.cli)
    rag-jax demo [--config x.yaml] [key=value ...]                   the end-to-end demo (rag_jax.recipes.rag_demo)
    rag-jax eval NAME [args]                                         an evaluation (EVALS: a paper's recipe or
                                                                     rag_jax.evaluation)
    rag-jax bench NAME [args]                                        a benchmark (rag_jax.benchmarks.NAME)
    rag-jax index --config x.yaml [key=value ...]                    build a retrieval index (rag_jax.retrieval.cli)
    rag-jax search OUTPUT_DIR "question" [...]                       query it
    rag-jax smoke                                                    a tiny end-to-end check

Errors in user input print one line (``rag-jax: error: ...``) and exit with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

# ``rag-jax eval NAME`` -> its module: each paper's experiments live in its recipe folder (rag_jax/recipes/),
# the evaluations that train nothing in rag_jax/evaluation/.
EVALS = {
    "block_distill": "rag_jax.recipes.block_attention.block_distill",
    "block_nq": "rag_jax.recipes.block_attention.block_nq",
    "block_quality": "rag_jax.recipes.block_attention.block_quality",
    "grit_eval": "rag_jax.recipes.grit.grit_eval",
    "grit_pretrained": "rag_jax.recipes.grit.grit_pretrained",
    "long_context": "rag_jax.recipes.em_llm.long_context",
    "needles": "rag_jax.recipes.needles.needles",
    "passkey": "rag_jax.recipes.em_llm.passkey",
    "rag_scaling": "rag_jax.recipes.rag_scaling.rag_scaling",
    "rapid": "rag_jax.recipes.rapid.rapid",
    "rag_qa": "rag_jax.evaluation.rag_qa",
    "retrieval_nq": "rag_jax.evaluation.retrieval_nq",
    "retrieval_recall": "rag_jax.evaluation.retrieval_recall",
    "sparse_rag": "rag_jax.recipes.sparse_rag.sparse_rag",
}
BENCHES = {name: f"rag_jax.benchmarks.{name}" for name in (
    "accelerator", "attention", "em_llm_bench", "grit_caching", "load_and_speed", "magicpig", "model_vs_torch",
    "retrieval_bench", "scan_layers", "train_bench", "ttft")}
SCRIPTS = {"eval": EVALS, "bench": BENCHES}
# Verbs whose arguments belong to another module's parser: (module, leading arguments).
DISPATCH = {"train": ("rag_jax.train.cli", []), "index": ("rag_jax.retrieval.cli", ["build"]),
            "search": ("rag_jax.retrieval.cli", ["query"])}


def _smoke(args) -> int:
    from flax import nnx

    from rag_jax.data.phantom import generate_universe
    from rag_jax.tokenizer import train_bpe
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
    from rag_jax.recipes.rag_demo import run_cli
    return run_cli(args)


def _script(verb: str, name: str, argv: list[str]) -> int:
    """``rag-jax eval|bench NAME args``: ``main(args)`` of that module."""
    names = SCRIPTS[verb]
    if name not in names:
        print(f"rag-jax: error: unknown {verb} {name!r}; valid: {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(names[name]).main(argv) or 0


def _dispatch(verb: str, argv: list[str]) -> int:
    module, lead = DISPATCH[verb]
    return importlib.import_module(module).main(lead + argv) or 0


def build_parser() -> argparse.ArgumentParser:
    from rag_jax.args import ScriptParser  # one-line errors; the verbs' subparsers inherit the class

    parser = ScriptParser(prog="rag-jax", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True)
    for verb, (module, _) in DISPATCH.items():
        sub.add_parser(verb, help=f"see rag-jax {verb} --help ({module})", add_help=False)
    for verb, names in SCRIPTS.items():
        p = sub.add_parser(verb, help=f"run NAME: {', '.join(names)}",
                           description=f"rag-jax {verb} NAME [args]: run NAME's module (rag_jax.cli.SCRIPTS). NAME is one of: "
                           f"{', '.join(names)}. 'rag-jax {verb} NAME --help' shows its arguments.")
        p.add_argument("name", metavar="NAME", help=", ".join(names))
        p.set_defaults(func=lambda args, verb=verb: _script(verb, args.name, []))
    smoke = sub.add_parser("smoke", help="generate data, train a tokenizer, build a tiny model, generate tokens")
    smoke.add_argument("--people", type=int, default=50)
    smoke.add_argument("--vocab-size", type=int, default=600)
    smoke.add_argument("--max-new-tokens", type=int, default=16)
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=_smoke)
    demo = sub.add_parser(
        "demo", help="the main job: universe -> reader base -> GRIT + Block-Attention fine-tuning -> ScaNN retrieval "
        "-> answers, TTFT, plots, metrics JSON, run folder (rag_jax/recipes/rag_demo/)",
        description="Train and evaluate a small retrieval-augmented model end to end (see rag_jax/recipes/rag_demo/). "
        "Default: a few minutes on 2 CPU cores.")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                      help="config overrides, e.g. train.steps=400 task.num_passages=3")
    demo.add_argument("--config", default=None, help="YAML config (e.g. train/configs/demo_gpu.yaml)")
    demo.add_argument("--data", default=None,
                      help="PhantomWiki-format folder (articles.json + questions.json) instead of generated universes")
    demo.add_argument("--out", default=None, help="output folder (report, plots, checkpoint); default runs/demo, "
                      "runs/demo_real with --model")
    demo.add_argument("--model", default=None,
                      help="real-model track: a pretrained chat model (e.g. smollm2-135m-instruct, a .gguf file or "
                      "an HF folder) answers zero-shot from the demo's retrieval; no training (rag_jax/recipes/rag_demo/real_model.py)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)
    from rag_jax.inference.chat import add_subcommands
    add_subcommands(sub)  # chat, generate, convert
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in DISPATCH:
            return _dispatch(argv[0], argv[1:])
        if len(argv) > 1 and argv[0] in SCRIPTS and not argv[1].startswith("-"):
            return _script(argv[0], argv[1], argv[2:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"rag-jax: error: {e}", file=sys.stderr)
        return 2


# glibc returns a freed buffer above its mmap threshold to the OS, so the next one of that size is page-faulted in
# again (~2 us per 4 KB page): Block-Attention's assembled passage cache (2 x 70 MB at 3K tokens on SmolLM2) cost
# ~20 ms of a ~250 ms time to first token that way (issue 28). Past 32 MB the threshold can only be raised by the
# environment at process start, so the console script re-executes itself once with it set (child processes, the
# benchmarks' baselines included, inherit it; RAG_JAX_MALLOC=0 turns this off).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32)}


def entry() -> None:
    """The ``rag-jax`` console script: ``main()`` in a process started with ``MALLOC_ENV`` (Linux)."""
    if (sys.platform == "linux" and sys.executable and os.environ.get("RAG_JAX_MALLOC", "1") != "0"
            and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items())):
        os.execve(sys.executable, list(sys.orig_argv), {**os.environ, **MALLOC_ENV})
    sys.exit(main())


if __name__ == "__main__":
    entry()
