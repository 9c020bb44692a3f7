"""RAPID on long-context prompts (Chen et al., ICML 2025; ``rag_jax.inference.rapid``): the target reads the whole
prompt (``--target full``: full attention, up to the model's context; ``--target em_llm``: EM-LLM over
``--em-config``, any length), the drafter the same prompt with its haystack replaced by the ``--top-k`` chunks BM25
ranks highest for the question (sentences or lines of the haystack, kept in their order), and RAPID decodes with
the drafter proposing ``--gamma`` tokens that the target verifies, at each ``--etas`` margin.

Prompts are ``long_context``'s tasks with a haystack (``haystack``: a PhantomWiki attribute question among
articles; ``passkey_once``; the RULER-style ones), ``--samples`` per ``--lengths``. Conditions per prompt, greedy:
the target alone, the drafter alone (RAG), and RAPID per ``eta``; each reply scored as ``long_context`` scores it.
Reported: accuracy, RAPID's acceptance rate, decode tokens/s (tokens emitted after the prefills over the time
after them; every condition decodes through the same compiled calls, compiled with the prefill; the target and the
drafter alone emit their first token from the prefill and then one per decode call), and the bytes one decode step
of the target and of the drafter reads (weights + KV), from which the context length where speculation can pay on
this machine follows (``inference.rapid.decode_bytes``). RAPID's target verifies each round in one decode call of
``gamma + 1`` tokens; the drafter decodes token by token.

    rag-jax eval rapid --task haystack --lengths 4096 --samples 5 --etas 0,1 --out runs/rapid/haystack.json
    rag-jax eval rapid --target em_llm --task haystack --lengths 16384 --samples 4 --etas 0,20

With ``--target em_llm`` the target verifies each round as one EM-LLM chunk (``memory.EMLLM.verify``: one
retrieval per round) and its compiled calls are warmed on a short prompt first; the bytes it reads per step are
those of its window, buffer, initial tokens and retrieved memory, not the whole prompt's KV.
"""
from __future__ import annotations

import json
import time

import numpy as np

from rag_jax.args import ScriptParser, input_file, int_list, integer, model_source, output_file, real_list
from rag_jax.atomic import write_text
from rag_jax.evaluation.chunk_rag import rag_content
from rag_jax.evaluation.tables import table
from rag_jax.inference.rapid import decode_bytes, rapid_generate, stream_generate
from rag_jax.model.load import load_model
from rag_jax.inference.chat import user_prompt
from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.recipes.em_llm.long_context import EM_CONFIG
from rag_jax.recipes.em_llm.tasks import FILLERS, MAX_NEW_TOKENS, make_prompts, score

TASKS = ("haystack", "nq", "passkey_once", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval rapid", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct", help="the target")
    p.add_argument("--drafter", type=model_source, default=None, help="the drafter (default: --model)")
    p.add_argument("--target", choices=("full", "em_llm"), default="full",
                   help="how the target reads the long prompt: full attention or EM-LLM (--em-config)")
    p.add_argument("--em-config", type=input_file, default=str(EM_CONFIG), help="EM-LLM settings (--target em_llm)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --em-config")
    p.add_argument("--task", choices=TASKS, default="haystack")
    p.add_argument("--filler", choices=FILLERS, default="phantom")
    p.add_argument("--lengths", type=int_list(64), default=[4096])
    p.add_argument("--samples", type=integer(1), default=4)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--top-k", type=integer(1), default=8, help="haystack chunks the drafter reads")
    p.add_argument("--gamma", type=integer(1), default=4, help="tokens drafted per round")
    p.add_argument("--etas", type=real_list(0), default=[0.0, 1.0],
                   help="knowledge-transfer margins, comma-separated (0 = plain speculative decoding)")
    p.add_argument("--max-new-tokens", type=integer(1), default=None)
    p.add_argument("--out", type=output_file, default=None)
    args = p.parse_args(argv)
    em_cfg = EMLLMConfig.from_yaml(args.em_config, args.set) if args.target == "em_llm" else None

    target = load_model(args.model)
    drafter = target if args.drafter is None else load_model(args.drafter)
    if target.tokenizer is None:
        p.error(f"argument --model: {args.model} has no tokenizer")
    new_tokens = args.max_new_tokens or MAX_NEW_TOKENS[args.task]
    reader = target.model
    if em_cfg is not None:
        reader = EMLLM(target.model, em_cfg)
        warm = list(range(1, 3 * em_cfg.chunk_size))             # compiles the chunk, verify and step calls
        rapid_generate(reader, warm, drafter.model, warm[:16], max_new_tokens=4, gamma=args.gamma)
    rows, conditions = [], ["target", "RAG drafter", *(f"RAPID eta={e:g}" for e in args.etas)]
    for length in args.lengths:
        for prompt in make_prompts(target, args.task, length, args.samples, args.seed, args.filler):
            query = prompt.parts[2]
            draft = user_prompt(target, rag_content(prompt.parts, query, args.top_k), prompt.prefix).ids
            row = {"length": length, "tokens": len(prompt.ids), "draft_tokens": len(draft), "depth": prompt.depth,
                   "answer": prompt.answer, "results": {}}
            for cond in conditions:
                t0 = time.perf_counter()
                if cond == "target":
                    out, stats = stream_generate(reader, prompt.ids.tolist(), max_new_tokens=new_tokens,
                                                 eos_id=target.eos_ids)
                elif cond == "RAG drafter":
                    out, stats = stream_generate(drafter.model, draft, max_new_tokens=new_tokens, eos_id=target.eos_ids)
                else:
                    out, stats = rapid_generate(reader, prompt.ids.tolist(), drafter.model, draft,
                                                max_new_tokens=new_tokens, gamma=args.gamma,
                                                eta=float(cond.split("=")[1]), eos_id=target.eos_ids)
                reply = target.tokenizer.decode(out, skip_special_tokens=True)
                row["results"][cond] = {
                    "reply": reply, "score": score(args.task, reply, prompt), "seconds": time.perf_counter() - t0,
                    "tokens": len(out), "decode_tokens": len(out) - (not cond.startswith("RAPID")),
                    "decode_seconds": stats.seconds, "prefill_seconds": stats.prefill_seconds,
                    "target_steps": stats.target_steps,
                    **({"acceptance": stats.acceptance_rate} if cond.startswith("RAPID") else {})}
                print(f"  {length:>6d} depth {prompt.depth:.2f} {cond:14s} {row['results'][cond]['score']:.2f} "
                      f"{reply!r}", flush=True)
            rows.append(row)
            if args.out is not None:
                write_text(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                                indent=1))
    table_rows = []
    for cond in conditions:
        res = [r["results"][cond] for r in rows]
        acc = [x["acceptance"] for x in res if "acceptance" in x]
        tps = [x["decode_tokens"] / x["decode_seconds"] for x in res if x["decode_seconds"] > 0 and x["decode_tokens"]]
        table_rows.append([cond, f"{np.mean([x['score'] for x in res]):.3f}", f"{np.mean(acc):.2f}" if acc else "",
                           f"{np.median(tps):.1f}" if tps else "", f"{np.median([x['seconds'] for x in res]):.1f}"])
    print(f"# RAPID, {args.task}, target {args.model} ({args.target}), drafter {args.drafter or args.model} (BM25 top {args.top_k} "
          f"chunks), gamma {args.gamma}, {len(rows)} prompts")
    print(table(["condition", "score", "acceptance", "decode tok/s", "median s/prompt"], table_rows))
    ctx = int(np.mean([r["tokens"] for r in rows]))
    if em_cfg is not None:   # window + buffer, initial tokens and retrieved memory
        ctx = min(ctx, em_cfg.n_init + em_cfg.n_mem + reader.buffer_len)
    dctx = int(np.mean([r["draft_tokens"] for r in rows]))
    tb, db = decode_bytes(target.config, ctx), decode_bytes(drafter.config, dctx)
    print(f"bytes per decode step (fp32): target {sum(tb.values()) / 1e6:.0f} MB at {ctx} tokens (KV "
          f"{tb['kv'] / 1e6:.0f} MB), drafter {sum(db.values()) / 1e6:.0f} MB at {dctx} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
