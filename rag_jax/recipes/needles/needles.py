"""Artificial Needles (Xiong et al., ICLR 2025, "From Artificial Needles to Real Haystacks"): fine-tune a chat model on
synthetic numeric key-value retrieval prompts (``rag_jax.data.needles``), loss on the answer only, and measure it on
held-out prompts of the same kind, with and without the answer template in the prompt (the paper's ablation, so
format learning is not read as retrieval).

Training (``--steps``): ``--train-rows`` prompts (seed 1; ``--dicts LO,HI`` dictionaries each, uniform; variants
of ``--variants``; the template as ``--train-template``), each the model's chat template around the prompt and the
answer sentence + end of turn, fine-tuned with ``rag_jax.train.finetune`` (``modes="full"``: full attention, the
top ``--top-layers`` layers and the final norm trained) into the run folder ``<--cache-dir>/run_<hash>`` (resumes
when killed; ``--model`` accepts it), then written as a rank-``--delta-rank`` bfloat16 delta
(``<run>/delta.safetensors``; the shipped ``smollm2-135m-instruct-needles`` is such a file).

Evaluation: ``--eval-rows`` held-out prompts (seed 2, the same sizes and variants), greedy replies of the base model
and of the tuned one (``--tuned``, or the model just trained), with the template and without; a reply is correct when
it holds the gold value (``reply_score``; the dictionary name is reported beside it); exact McNemar test of tuned vs
base on the same prompts.

    rag-jax eval needles --eval-rows 40                                          # the base model only
    rag-jax eval needles --steps 60 --train-rows 240 --batch-size 4 --top-layers 8 --eval-rows 60
    rag-jax eval needles --tuned smollm2-135m-instruct-needles --eval-rows 60     # the shipped delta
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from rag_jax.args import ScriptParser, int_list, integer, model_source, names, output_file, real
from rag_jax.atomic import write_text
from rag_jax.data.block_rag import BlockExample
from rag_jax.data.needles import VARIANTS, needle_example, reply_score
from rag_jax.evaluation.rag import greedy_replies, memo_json
from rag_jax.evaluation.stats import mcnemar
from rag_jax.evaluation.tables import table
from rag_jax.inference.chat import user_prompt
from rag_jax.inference.kv_store import model_fingerprint
from rag_jax.model.delta import low_rank_delta, relative_error, save_delta
from rag_jax.model.load import load_model
from rag_jax.text import encode_content
from rag_jax.train.finetune import FinetuneConfig, finetune


def examples(seed: int, count: int, dicts: tuple[int, int], variants, template: bool) -> list:
    """``count`` ``NeedleExample``s: prompt ``i`` from ``np.random.default_rng([seed, i])``, its dictionary count
    uniform in ``dicts`` and its variant ``variants[i % len(variants)]``."""
    out = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        out.append(needle_example(rng, num_dicts=int(rng.integers(dicts[0], dicts[1] + 1)),
                                  variant=variants[i % len(variants)], template=template))
    return out


def training_rows(loaded, exs) -> list[BlockExample]:
    """One single-block ``BlockExample`` per example: the prompt ids, response = answer + the first end id."""
    return [BlockExample([list(user_prompt(loaded, ex.prompt).ids)],
                         [*encode_content(loaded.tokenizer, ex.answer), loaded.eos_ids[0]]) for ex in exs]


def answer(loaded, model, exs, *, max_new_tokens: int, batch_size: int, cache: Path, key: str) -> list[str]:
    """Greedy replies of ``model`` to ``exs`` (cached in ``cache`` under the weights' fingerprint)."""
    prompts = [[list(user_prompt(loaded, ex.prompt).ids)] for ex in exs]
    keys = [hashlib.sha256(json.dumps([key, max_new_tokens, p]).encode()).hexdigest() for p in prompts]
    by_key = dict(zip(keys, prompts))
    return memo_json(cache, keys, lambda todo: greedy_replies(loaded, model, [by_key[k] for k in todo],
                                                              max_new_tokens=max_new_tokens, batch_size=batch_size))


def train(loaded, args, dicts, variants):
    """Fine-tune ``loaded`` on the training prompts (module docstring) and write the delta; returns ``(the tuned
    model as loaded from its delta, or from the run folder with --delta-rank 0; the training record)``."""
    rows = training_rows(loaded, examples(1, args.train_rows, dicts, variants, args.train_template == "on"))
    seq_len = -(-max(r.num_tokens for r in rows) // 64) * 64
    cfg = FinetuneConfig(steps=args.steps, batch_size=args.batch_size, seq_len=seq_len,
                         train_layers=args.top_layers, learning_rate=args.lr, warmup_steps=args.warmup,
                         save_every=max(1, min(20, args.steps)), modes="full",
                         lora_rank=args.lora_rank)
    recipe = {"model": str(args.model), "dicts": list(dicts), "variants": list(variants),
              "train_rows": args.train_rows, "train_template": args.train_template,
              "finetune": dataclasses.asdict(cfg)}
    run_dir = args.cache_dir / f"run_{hashlib.sha1(json.dumps(recipe, default=str).encode()).hexdigest()[:10]}"
    print(f"fine-tuning: {len(rows)} rows, {np.mean([r.num_tokens for r in rows]):.0f} tokens on average "
          f"(seq_len {seq_len}); {cfg}; {run_dir}", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    result = finetune(loaded, rows, cfg, run_dir, extra_config={"needles": recipe})
    record = {"run_dir": str(run_dir), "steps": result.step, "wall_seconds": time.perf_counter() - t0,
              "cpu_seconds": time.process_time() - c0, "history": result.history}
    tuned = load_model(run_dir)
    print(f"tuned model: {run_dir} (--model accepts it)", flush=True)
    if args.delta_rank:
        delta = low_rank_delta(loaded.model, tuned.model, args.delta_rank)
        path = save_delta(run_dir / "delta.safetensors", delta, {"base": str(args.model)})
        err = relative_error(loaded.model, tuned.model, delta)
        record["delta"] = {"path": str(path), "bytes": path.stat().st_size, "rank": args.delta_rank,
                           "max_relative_error": max(err.values())}
        print(f"delta: {path} ({path.stat().st_size / 1e6:.1f} MB, rank {args.delta_rank}, max relative error "
              f"{max(err.values()):.3f})", flush=True)
        tuned = load_model(path)
    return tuned, record


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval needles", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct")
    p.add_argument("--tuned", type=model_source, default=None, help="score this tuned model instead of training")
    p.add_argument("--variants", type=names(VARIANTS), default=list(VARIANTS))
    p.add_argument("--dicts", type=int_list(1, 400), default=[20, 60], help="LO,HI dictionaries per prompt")
    p.add_argument("--train-rows", type=integer(1), default=240)
    p.add_argument("--train-template", choices=("on", "off"), default="on")
    p.add_argument("--steps", type=integer(0), default=0, help="fine-tuning steps; 0 = no training")
    p.add_argument("--batch-size", type=integer(1), default=4)
    p.add_argument("--top-layers", type=integer(0), default=8, help="top layers trained (0 = all)")
    p.add_argument("--lora-rank", type=integer(0), default=0,
                   help="train rank-R LoRA adapters (flax nnx.LoRA) on the top layers' projections instead of "
                        "their weights; 0 = the weights")
    p.add_argument("--lr", type=real(0, lo_open=True), default=1e-4)
    p.add_argument("--warmup", type=integer(0), default=5)
    p.add_argument("--delta-rank", type=integer(0), default=32, help="rank of the written delta; 0 = none")
    p.add_argument("--eval-rows", type=integer(1), default=40)
    p.add_argument("--max-new-tokens", type=integer(1), default=40)
    p.add_argument("--eval-batch-size", type=integer(1), default=4)
    p.add_argument("--cache-dir", type=Path, default=Path("runs/needles"))
    p.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = p.parse_args(argv)
    if len(args.dicts) != 2 or args.dicts[0] > args.dicts[1]:
        p.error(f"argument --dicts: {','.join(map(str, args.dicts))} must be LO,HI with LO <= HI")
    if args.tuned is not None and args.steps:
        p.error(f"argument --tuned: {args.tuned} is scored instead of training; drop --steps {args.steps}")

    wall = time.perf_counter()
    loaded = load_model(args.model)
    if loaded.tokenizer is None or not loaded.eos_ids:
        p.error(f"argument --model: {args.model} needs a tokenizer and an end-of-turn token")
    dicts, variants = tuple(args.dicts), tuple(args.variants)
    info: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    models = {"base": loaded}
    if args.steps:
        models["tuned"], info["finetune"] = train(loaded, args, dicts, variants)
    elif args.tuned is not None:
        models["tuned"] = load_model(args.tuned)

    results, table_rows = {}, []
    for template in (True, False):
        held_out = examples(2, args.eval_rows, dicts, variants, template)
        base_correct = None
        for name, m in models.items():
            t0 = time.perf_counter()
            replies = answer(loaded, m.model, held_out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.eval_batch_size, cache=args.cache_dir / "replies.json",
                             key=model_fingerprint(m.model, m.config))
            scores = [reply_score(r, ex) for r, ex in zip(replies, held_out)]
            value = [s["value"] for s in scores]
            base_correct = value if name == "base" else base_correct
            only, only_base, pval = mcnemar(value, base_correct)
            cond = f"{name}, template {'on' if template else 'off'}"
            results[cond] = {"value_accuracy": float(np.mean(value)),
                             "dictionary_accuracy": float(np.mean([s["dictionary"] for s in scores])),
                             "only_this": only, "only_base": only_base, "p": pval, "replies": replies,
                             "seconds": time.perf_counter() - t0}
            table_rows.append([cond, f"{np.mean(value):.3f}", f"{results[cond]['dictionary_accuracy']:.3f}",
                               "" if name == "base" else f"{only} vs {only_base}", "" if name == "base" else f"{pval:.2g}"])
            print(f"  {cond}: value {np.mean(value):.3f} ({time.perf_counter() - t0:.0f} s); e.g. {replies[0]!r}",
                  flush=True)
    print(f"# {args.model}: {args.eval_rows} held-out synthetic KV prompts ({dicts[0]}-{dicts[1]} dictionaries, "
          f"{', '.join(variants)})")
    print(table(["model, prompt", "value acc.", "dictionary acc.", "discordant vs base", "McNemar p"], table_rows))
    info["results"], info["wall_seconds"] = results, time.perf_counter() - wall
    if args.out is not None:
        write_text(args.out, json.dumps(info, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
