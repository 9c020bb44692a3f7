"""MagicPIG's LSH-sampled decode attention vs TopK at equal budget vs exact attention, on a pretrained model.

For each ``--lengths`` and each of ``--samples`` passkey prompts (``rag_jax.recipes.em_llm.long_context``; the key at
depths ``(i + 0.5) / samples``) the prompt is prefilled once (exact attention) and then, from the same cache:

1. **Estimator error**: the first decode step's queries of every layer (recorded through
   ``Transformer.decode(attend=...)``) attend the cache exactly, with each ``--lsh K:L`` MagicPIG setting
   (``rag_jax.inference.magicpig``; sinks 4, local window 64, ≥ 2 colliding tables) and with TopK keeping, per
   head, the number of middle keys that setting sampled on average (equal budget). Reported: the fraction of
   middle keys used and the attention output's relative L2 error ``|ô - o| / |o|``, averaged over heads, prompts
   and the sampled layers (the first and the middle layer stay exact, as the reference keeps layers 0 and 16 of
   Llama-3.1-8B).
2. **Task accuracy**: the greedy reply (``--new-tokens``) of each method; correct when its first number is the key.
3. **Decode ms/token** (``--time``): ``(t(1 + n new tokens) - t(1 new token)) / n``, median of ``--repeats``, for
   exact attention and the first LSH setting with its TopK twin. MagicPIG is evaluated densely (every middle
   key's collision count and score; ``magicpig`` module doc) unless ``--gather F``: then the first setting also
   runs through bucket tables (``MagicPIGDecode(bucket_size, max_sampled)``: each query reads its bucket in every
   table, at most F times the mean bucket ``length / 2^K``, and gathers at most F times the mean number of keys
   the dense evaluation sampled; on CPU one C++ kernel per layer and step, ``cpu_kernel.lsh_attend``), its
   accuracy and decode ms/token reported as ``magicpig K:L gathered``.

Over the plain cache the first reply token comes from the exact prefill; MagicPIG and TopK act from the second on.

``--base em_llm`` (SmolLM2-135M was trained to 8,192 tokens; longer prompts need EM-LLM's memory): the policies
estimate EM-LLM's retrieved events and out-of-window buffer at each decode step (``memory.EMLLM(...,
decode_attention=...)``; init tokens and the local window exact; the first reply token comes from the prompt's
last token, which EM-LLM decodes as a step, so they act from the first on), ``--em-config`` / ``--set`` as
``eval long_context`` (raise ``n_mem`` to give the sampler a memory worth sampling). Per prompt: exact EM-LLM;
per LSH setting a measured MagicPIG stream (``measure=True``: exact attention computed beside the estimate at
every decode step, at the same inputs, for its error; the stream goes on with the estimate, so its reply is
MagicPIG's) and a measured TopK stream whose budget is the MagicPIG stream's mean number of keys used.
Decode ms/token (first prompt of each length): the median decode step of unmeasured streams (EM-LLM's prefill
dominates a prompt's time, so the steps are timed alone).

    rag-jax bench magicpig --model smollm2-135m-instruct --lengths 4096 8000 --samples 4 --threads 2
    rag-jax bench magicpig --lengths 2048 --samples 2 --lsh 8:40 --no-time      # quick
    rag-jax bench magicpig --base em_llm --lengths 16384,32768 --samples 2 --lsh 8:75 --set n_mem=2048
"""
from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.atomic import write_text
from rag_jax.args import ScriptParser, input_file, int_list, integer, model_source, output_file, real
from rag_jax.recipes.em_llm.tasks import correct, passkey_prompts
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import cpu_threads, median_ms
from rag_jax.inference.generate import generate
from rag_jax.inference.magicpig import MagicPIGDecode, TopKDecode
from rag_jax.model.attention import attend_cache
from rag_jax.model.kv import DecodeCache, KVSegment
from rag_jax.model.load import load_model
from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.recipes.em_llm.long_context import EM_CONFIG


def lsh_setting(text: str) -> tuple[int, int]:
    """``"K:L"`` -> (bits, tables); argparse type."""
    try:
        bits, tables = (int(x) for x in text.split(":"))
        MagicPIGDecode(bits=bits, tables=tables)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected BITS:TABLES, e.g. 10:150; got {text!r} ({e})") from None
    return bits, tables


def record_step(model, ids: np.ndarray) -> tuple[KVSegment, list, int]:
    """Prefill ``ids[:-1]`` once; then the last prompt token and the first decode step, whose per-layer
    ``(q, kt, vt, mask)`` are recorded. Returns (the prefix KVSegment, the records, the greedy first token)."""
    n = len(ids)
    tokens = jnp.asarray(ids[None, :-1])
    prefix = model(tokens, jnp.arange(n - 1)[None], jnp.ones_like(tokens)).kv
    last = model(jnp.asarray(ids[None, -1:]), jnp.full((1, 1), n - 1), jnp.ones((1, 1), jnp.int32), kv_cache=prefix)
    cfg = model.config
    cache = KVSegment.concat([prefix, last.kv, KVSegment.empty(cfg.num_layers, 1, 1, cfg.num_kv_heads,
                                                               cfg.head_dim, prefix.k.dtype)])
    records = []

    def attend(layer, q, kt, vt, mask):
        records.append((q, kt, vt, mask))
        return attend_cache(q, kt, vt, mask)
    first = jnp.argmax(last.logits[:, -1], -1).astype(jnp.int32)
    model.decode(first, jnp.full((1,), n), DecodeCache.from_segment(cache, model.inv_freq), n, attend=attend)
    return prefix, records, int(first[0])


def dense_layers(num_layers: int) -> tuple[int, ...]:
    """The reference's choice for Llama-3.1-8B (layers 0 and 16 of 32 exact), scaled: the first and the middle."""
    return (0, num_layers // 2)


def step_errors(records, prompt_end: int, settings) -> dict:
    """Per method: (mean relative error, mean fraction of middle keys used) over the recorded sampled layers
    (``dense_layers`` excluded) and heads."""
    out = {}
    dense = dense_layers(len(records))
    for bits, tables in settings:
        pig = MagicPIGDecode(bits=bits, tables=tables)
        top_errors, pig_errors, fractions = [], [], []
        for layer, (q, kt, vt, mask) in enumerate(records):
            if layer in dense:
                continue
            exact = attend_cache(q, kt, vt, mask)
            cache = DecodeCache(k=(kt,), v=(vt,), positions=None, segment_ids=mask[:, 0].astype(jnp.int32))
            index = pig.prepare(cache, prompt_end)
            sampled, _ = pig.sample(index, 0, q, kt)
            middle = int(index.middle.sum())
            fractions.append(float(sampled.sum(-1).mean()) / max(middle, 1))
            pig_errors.append(_relative(pig.attend(index, 0, q, kt, vt, mask), exact))
            top = TopKDecode(budget=max(int(round(fractions[-1] * middle)), 1))
            top_errors.append(_relative(top.attend(top.prepare(cache, prompt_end), 0, q, kt, vt, mask), exact))
        frac = float(np.mean(fractions))
        out[f"magicpig {bits}:{tables}"] = (float(np.mean(pig_errors)), frac)
        out[f"topk @ {bits}:{tables}"] = (float(np.mean(top_errors)), frac)
    return out


def em_rows(loaded, cfg: EMLLMConfig, prompt, settings, new_tokens: int, time_steps: bool) -> dict:
    """One passkey prompt with EM-LLM as the base (module doc) -> per method ``{"reply": ids, "rel_error",
    "fraction", "ms_per_token"}``: error and fraction from the measured stream (``EMLLM(measure=True)``, means
    over the decode steps and the layers outside ``dense_layers``); ``ms_per_token`` (with ``time_steps``) the
    median decode step of an unmeasured stream, else None."""
    model, ids = loaded.model, prompt.ids
    dense = dense_layers(loaded.config.num_layers)

    def run(policy, measure):
        em = EMLLM(model, cfg, decode_attention=policy, measure=measure)
        logits, out, ms, estimates = em.prefill(ids), [], [], []
        while True:
            estimates += [np.asarray(e) for layer, e in enumerate(em.estimates) if layer not in dense and e is not None]
            out.append(int(np.argmax(logits)))
            if len(out) == new_tokens or out[-1] in loaded.eos_ids:
                break
            t0 = time.perf_counter()
            logits = np.asarray(em.step(out[-1]))
            ms.append(1000 * (time.perf_counter() - t0))
        est = np.asarray(estimates).reshape(-1, 3)
        return {"reply": out, "ms": float(np.median(ms[1:] or ms)) if ms else None,
                "rel_error": float(est[:, 0].mean()) if len(est) else 0.0,
                "fraction": float(est[:, 1].mean()) if len(est) else 1.0,
                "keys": float(est[:, 2].mean()) if len(est) else 0.0}

    exact = run(None, False)
    rows = {"exact": {**exact, "ms_per_token": exact["ms"] if time_steps else None}}
    for bits, tables in settings:
        pig = MagicPIGDecode(bits=bits, tables=tables, dense_layers=dense)
        measured = run(pig, True)
        top = TopKDecode(budget=max(int(round(measured["fraction"] * measured["keys"])), 1), dense_layers=dense)
        for name, policy, row in ((f"magicpig {bits}:{tables}", pig, measured),
                                  (f"topk @ {bits}:{tables}", top, run(top, True))):
            rows[name] = {**row, "ms_per_token": run(policy, False)["ms"] if time_steps else None}
    return rows


def _relative(x, exact) -> float:
    x, exact = np.asarray(x, np.float64), np.asarray(exact, np.float64)
    return float((np.linalg.norm(x - exact, axis=-1) / np.maximum(np.linalg.norm(exact, axis=-1), 1e-30)).mean())


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax bench magicpig", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct")
    p.add_argument("--lengths", type=int_list(256), default="4096,8000", help="prompt lengths in tokens")
    p.add_argument("--samples", type=integer(1), default=4, help="passkey prompts per length")
    p.add_argument("--lsh", type=lsh_setting, nargs="+", default=[(10, 150), (8, 75)],
                   help="MagicPIG settings BITS:TABLES (K:L)")
    p.add_argument("--new-tokens", type=integer(1), default=12, help="greedy reply tokens")
    p.add_argument("--time", action=argparse.BooleanOptionalAction, default=True,
                   help="decode ms/token of exact, the first LSH setting and its TopK twin")
    p.add_argument("--gather", type=real(0), default=0.0,
                   help="also run the first LSH setting through bucket tables with capacities F times the mean "
                        "bucket and sample (0 = off; plain cache only)")
    p.add_argument("--repeats", type=integer(1), default=3)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--threads", type=integer(0), default=0, help="cores (CPU affinity; 0 = unpinned)")
    p.add_argument("--base", choices=("cache", "em_llm"), default="cache",
                   help="the long KV the policies estimate: the plain decode cache or EM-LLM's memory")
    p.add_argument("--em-config", type=input_file, default=str(EM_CONFIG), help="EM-LLM settings (--base em_llm)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --em-config")
    p.add_argument("--out", type=output_file, default=None, help="JSON report")
    args = p.parse_args(argv)
    em_cfg = EMLLMConfig.from_yaml(args.em_config, args.set) if args.base == "em_llm" else None
    cpu_threads(args.threads)
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    longest = max(args.lengths) + args.new_tokens + 32
    if em_cfg is None and longest > loaded.config.max_seq_len:
        p.error(f"argument --lengths: {max(args.lengths)} + reply exceeds {args.model}'s "
                f"max_seq_len={loaded.config.max_seq_len}")
    t0 = time.perf_counter()
    report = {"model": str(args.model), "lsh": args.lsh, "base": args.base, "lengths": {},
              **({"em_config": em_cfg.to_dict()} if em_cfg else {})}
    for length in args.lengths:
        errors, hits, timing, budgets = {}, {}, {}, {}
        for i, prompt in enumerate(passkey_prompts(loaded, length, args.samples, args.seed, "repeat")):
            if em_cfg is not None:
                for name, row in em_rows(loaded, em_cfg, prompt, args.lsh, args.new_tokens,
                                         args.time and i == 0).items():
                    errors.setdefault(name, []).append((row["rel_error"], row["fraction"]))
                    hits.setdefault(name, []).append(bool(correct("passkey", tok.decode(row["reply"]), prompt.answer)))
                    if row["ms_per_token"] is not None:
                        timing[name] = row["ms_per_token"]
                print(f"  {length} tokens, prompt {i + 1}/{args.samples}: "
                      + ", ".join(f"{k} {v[-1]}" for k, v in hits.items()), flush=True)
                continue
            prefix, records, _ = record_step(model, prompt.ids)
            for name, (err, frac) in step_errors(records, len(prompt.ids), args.lsh).items():
                errors.setdefault(name, []).append((err, frac))
            policies = {"exact": None}
            dense = dense_layers(loaded.config.num_layers)
            for bits, tables in args.lsh:
                pig = MagicPIGDecode(bits=bits, tables=tables, dense_layers=dense)
                policies[f"magicpig {bits}:{tables}"] = pig
                # the budget (keys) from the first prompt of the length: a static field, one compiled loop per length
                name = f"topk @ {bits}:{tables}"
                if name not in budgets:
                    middle = len(prompt.ids) - pig.sink_tokens - pig.local_tokens
                    budgets[name] = max(int(round(errors[name][0][1] * middle)), 1)
                policies[name] = TopKDecode(budget=budgets[name], dense_layers=dense)
                if args.gather and (bits, tables) == args.lsh[0]:
                    name = f"magicpig {bits}:{tables} gathered"
                    if name not in budgets:
                        middle = len(prompt.ids) - pig.sink_tokens - pig.local_tokens
                        budgets[name] = (math.ceil(args.gather * len(prompt.ids) / 2 ** bits),
                                         math.ceil(args.gather * errors[f"magicpig {bits}:{tables}"][0][1] * middle))
                    policies[name] = MagicPIGDecode(bits=bits, tables=tables, dense_layers=dense,
                                                    bucket_size=budgets[name][0], max_sampled=budgets[name][1])

            def reply(policy, new_tokens):
                return generate(model, [prompt.ids[-1:]], max_new_tokens=new_tokens, eos_id=loaded.eos_ids,
                                kv_cache=prefix, decode_attention=policy)
            for name, policy in policies.items():
                text = tok.decode([int(t) for t in reply(policy, args.new_tokens)[0]])
                hits.setdefault(name, []).append(bool(correct("passkey", text, prompt.answer)))
            if args.time and i == 0:
                first = f"magicpig {args.lsh[0][0]}:{args.lsh[0][1]}"
                for name in ("exact", first, first.replace("magicpig", "topk @")) + (
                        (first + " gathered",) if args.gather else ()):
                    one = median_ms(lambda: reply(policies[name], 1), args.repeats)
                    many = median_ms(lambda: reply(policies[name], 1 + args.new_tokens), args.repeats)
                    timing[name] = (many - one) / args.new_tokens
            print(f"  {length} tokens, prompt {i + 1}/{args.samples}: "
                  + ", ".join(f"{k} {v[-1]}" for k, v in hits.items()), flush=True)
        exact = {"exact": (0.0, 1.0)}                          # the gathered variant's error is not measured
        rows = {name: {"correct": sum(h), "n": len(h),
                       "rel_error": float(np.mean([e for e, _ in errors[name]])) if name in errors else exact.get(
                           name, (None,))[0],
                       "fraction": float(np.mean([f for _, f in errors[name]])) if name in errors else exact.get(
                           name, (None, None))[1],
                       "ms_per_token": timing.get(name)} for name, h in hits.items()}
        report["lengths"][length] = rows
        print(f"\n{length} tokens, {args.samples} passkey prompts ({args.model}, base: {args.base})")
        print(table(["method", "keys used", "rel. error", "passkey", "decode ms/token"],
                    [[k, "-" if r["fraction"] is None else f"{r['fraction']:.3f}",
                      "-" if r["rel_error"] is None else f"{r['rel_error']:.4f}", f"{r['correct']}/{r['n']}",
                      "-" if r["ms_per_token"] is None else f"{r['ms_per_token']:.1f}"] for k, r in rows.items()],
                    floatfmt=("", ".3f", ".4f", "", ".1f")), flush=True)
    report["seconds"] = time.perf_counter() - t0
    print(f"\n{report['seconds']:.0f} s")
    if args.out:
        write_text(args.out, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
