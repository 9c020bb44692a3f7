"""Dump the passkey prompts of ``rag-jax eval long_context`` (token ids, keys, depths, key token indices) to JSON,
so another implementation (the EM-LLM reference, ``run_em_llm_reference.py``) can read the same ids.

    PYTHONPATH=$PWD python eval/reference/dump_passkey_prompts.py --length 4096 --samples 10 --out /tmp/ref/prompts_4096.json

JSON: ``{"length", "seed", "filler", "model", "eos_ids": [int], "prompts": [{"ids": [int], "key": str,
"depth": float, "evidence": [int]}]}`` (``evidence``: indices of the key's tokens in ``ids``).
"""
from __future__ import annotations

import json

from rag_jax.args import ScriptParser, integer, model_source, output_file


def main(argv=None) -> int:
    p = ScriptParser(prog="dump_passkey_prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct")
    p.add_argument("--length", type=integer(1), required=True, help="prompt length in tokens")
    p.add_argument("--samples", type=integer(1), required=True, help="prompts (depths (i + 0.5) / samples)")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--filler", default="repeat", choices=("repeat", "phantom"))
    p.add_argument("--out", type=output_file, required=True)
    args = p.parse_args(argv)
    from rag_jax.recipes.em_llm.tasks import passkey_prompts
    from rag_jax.model.load import load_model

    loaded = load_model(args.model)
    prompts = passkey_prompts(loaded, args.length, args.samples, args.seed, args.filler)
    out = {"length": args.length, "seed": args.seed, "filler": args.filler, "model": str(args.model),
           "eos_ids": [int(i) for i in loaded.eos_ids],
           "prompts": [{"ids": q.ids.tolist(), "key": q.answer, "depth": q.depth, "evidence": q.evidence.tolist()}
                       for q in prompts]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))
    print(f"wrote {len(prompts)} prompts of {[len(q.ids) for q in prompts]} tokens to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
