"""Block-Attention quality at small scale: full-attention vs block fine-tuning, full vs block inference.

Block-Attention (ICLR 2025, §3 and Table 1; research note ``shared/research/block_attention.md``
§1.4-1.6). Two models are fine-tuned from the same initial weights on the same multi-document QA
examples, in the same order, for the same number of steps:

- ``full-FT``: full-attention RAG fine-tuning (``BlockLoss(full_weight=1, block_weight=0)``),
  the paper's Tulu3-RAG baseline;
- ``block-FT``: every example in both full and block mode (``BlockLoss()``, 1:1), with the
  ``[Block-Attention]`` marker in block mode, the paper's Tulu3-Block-FT recipe.

Both are then scored under full inference and under block inference (cached passage blocks
re-encoded to their offsets; ``rag_jax.inference.block_attention``), greedy decoding. Accuracy is
PhantomWiki's set exact match (``rag_jax.metrics.phantom_set_metrics``); F1 is its set F1. The paper
reports block-FT in block mode 1.3 points under the full-attention baseline (a reproduction: 4.6);
a full-FT model in block mode is expected to collapse (note §1.6 sanity baseline).

Data: questions over PhantomWiki-style universes (``rag_jax.data.phantom.generate_universe``, or a
PhantomWiki folder such as ``shared/data/phantomwiki/depth6_seed11``). Each example holds the gold
articles plus random distractor articles of the same universe, shuffled, one passage per block.
Training universes and the evaluation universe differ, so answers must be read from the passages.

The recipe (model, optimizer, data, objective, steps) is a YAML file, ``train/configs/block_*.yaml``,
with ``key=value`` overrides (``rag_jax.config``):

    rag-jax eval block_quality                                  # block_phantom_cpu.yaml, a few minutes
    rag-jax eval block_quality train.steps=50 eval.questions=32  # quicker smoke run
    rag-jax eval block_quality --config train/configs/block_llama3.2_1b_h200.yaml --model /ckpt/llama
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from rag_jax import config as config_lib
from rag_jax import sharding
from rag_jax.atomic import write_text
from rag_jax.data import block_rag
from rag_jax.data.loaders import load_phantomwiki
from rag_jax.data.phantom import generate_universe
from rag_jax.args import ScriptParser, input_dir, input_file, output_file
from rag_jax.evaluation.models import load_for_eval
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.metrics import phantom_set_metrics
from rag_jax.model import ModelConfig
from rag_jax.text import Markup
from rag_jax.tokenizer import train_bpe
from rag_jax.train import optim, trainer
from rag_jax.train.objectives.block import BlockLoss

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "train" / "configs" / "block_phantom_cpu.yaml"
SPECIAL_TOKENS = ("<pad>", "<|user|>", "<|assistant|>", "<|end_of_text|>", block_rag.BLOCK_MARKER)
# A compact RAG template for small models (same block structure as the paper's, fewer tokens);
# template="paper" uses the v5 strings of rag_jax.data.block_rag.
COMPACT_SYSTEM = "<|user|>\nAnswer the question using the documents.\n\n"
COMPACT_LAST = "\nQuestion: {question}\n<|assistant|>\n"


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Attributes:
      train_universes: generated universes for training (seeds 1..n); ignored when ``train_dir`` is set.
      train_dir: a PhantomWiki folder to train on instead (its questions minus the evaluation ones).
      eval_dir: a PhantomWiki folder to evaluate on; None = a generated universe (seed ``eval_seed``).
      eval_seed: seed of the generated evaluation universe (differs from the training seeds).
      people / questions_per_universe / max_hops: generated universe sizes (``generate_universe``).
      questions: "all", or "lookup": single-answer questions that copy a value from a passage (no
        counting questions), which small models learn in far fewer steps.
      passage_unit: "article" (one PhantomWiki article per passage) or "line" (one fact line of an
        article per passage, the article title kept; short contexts that small models learn to read).
      passages: passages per example (gold passages + distractors); questions needing more gold
        passages than this are skipped.
      passages_per_block: passages grouped into one block.
      template: "compact" (short instruction, small models) or "paper" (v5 Tulu strings).
      seq_len: training row length in tokens; longer examples are skipped.
      vocab_size: BPE vocabulary trained on the data (ignored with ``init.hf_dir``: its tokenizer).
    """

    train_universes: int = 8
    train_dir: str | None = None
    eval_dir: str | None = None
    eval_seed: int = 10_000
    people: int = 40
    questions_per_universe: int = 150
    max_hops: int = 1
    questions: str = "all"
    passage_unit: str = "article"
    passages: int = 3
    passages_per_block: int = 1
    template: str = "compact"
    seq_len: int = 512
    vocab_size: int = 1024

    def __post_init__(self):
        if self.questions not in ("all", "lookup"):
            raise ValueError(f"data.questions={self.questions!r}; valid: 'all', 'lookup'")
        if self.passage_unit not in ("article", "line"):
            raise ValueError(f"data.passage_unit={self.passage_unit!r}; valid: 'article', 'line'")
        if self.template not in ("compact", "paper"):
            raise ValueError(f"data.template={self.template!r}; valid: 'compact', 'paper'")
        if self.passages < 1 or self.passages_per_block < 1 or self.train_universes < 1:
            raise ValueError("data.passages, data.passages_per_block and data.train_universes must be >= 1")


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """Block-FT objective (``BlockLoss``): pass weights and the block-mode marker."""

    full_weight: float = 1.0
    block_weight: float = 1.0
    marker: bool = True


@dataclasses.dataclass(frozen=True)
class InitSection:
    """Attributes:
      hf_dir: start from this model (``--model``): a run folder or an HF checkpoint folder, with its
        tokenizer.json (``rag_jax.evaluation.models.load_for_eval``); None = random init from ``model`` and
        ``train.seed``.
      base_steps: first train a shared base for this many steps with full attention only (standing in
        for the paper's SFT model, which already reads passages); both fine-tunes start from it.
    """

    hf_dir: str | None = None
    base_steps: int = 0


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Attributes:
      questions: held-out questions scored per model and mode.
      train_questions: training questions also scored (full inference), to tell reading from memorizing.
      batch_size / max_new_tokens: greedy generation batch and length.
    """

    questions: int = 100
    train_questions: int = 50
    batch_size: int = 25
    max_new_tokens: int = 24


@dataclasses.dataclass(frozen=True)
class BlockRecipe:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
    optimizer: optim.OptimizerConfig = dataclasses.field(default_factory=optim.OptimizerConfig)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    objective: ObjectiveSection = dataclasses.field(default_factory=ObjectiveSection)
    train: trainer.TrainConfig = dataclasses.field(                     # the one run config's train section
        default_factory=lambda: trainer.TrainConfig(steps=300, global_batch_size=16, log_every=50))
    init: InitSection = dataclasses.field(default_factory=InitSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)


def _universe_from_dir(folder: str) -> tuple[list[dict], list[dict]]:
    data = load_phantomwiki(folder)
    articles = [{"title": a.title, "text": a.article} for a in data.articles]
    questions = [{"question": q.question, "answer": list(q.answer), "hops": q.hops, "titles": list(q.titles or ())}
                 for q in data.questions]
    return articles, questions


def _generated(seed: int, d: DataSection, num_questions: int) -> tuple[list[dict], list[dict]]:
    u = generate_universe(num_people=d.people, seed=seed, max_hops=d.max_hops, num_questions=num_questions)
    return [{"title": a["title"], "text": a["article"]} for a in u.articles], u.questions


def load_universes(d: DataSection, eval_questions: int) -> tuple[list, list]:
    """([(articles, questions) for training], [(articles, questions) for evaluation]).

    Generated evaluation universes (seeds ``eval_seed``, ``eval_seed + 1``, ...) hold about three times
    ``eval_questions`` questions, since filters drop some.
    """
    if d.eval_dir:
        held_out = [_universe_from_dir(d.eval_dir)]
    else:
        n = -(-3 * max(eval_questions, 1) // d.questions_per_universe)
        held_out = [_generated(d.eval_seed + i, d, d.questions_per_universe) for i in range(n)]
    if d.train_dir:
        articles, questions = _universe_from_dir(d.train_dir)
        eval_texts = {q["question"] for _, qs in held_out for q in qs}
        train = [(articles, [q for q in questions if q["question"] not in eval_texts])]
    else:
        train = [_generated(seed, d, d.questions_per_universe) for seed in range(1, d.train_universes + 1)]
    return train, held_out


def _passage_pool(articles, unit: str) -> list[dict]:
    """Passages ``{"title", "text"}``: whole articles, or their fact lines (chunks of the article split
    at ``"\n"`` by ``block_rag.split_by_delimiter``, markdown headings dropped)."""
    if unit == "article":
        return list(articles)
    pool = []
    for a in articles:
        for chunk in block_rag.split_by_delimiter(a["text"].replace("\n\n", "\n")):
            line = chunk.strip()
            if line and not line.startswith("#"):
                pool.append({"title": a["title"], "text": line})
    return pool


def make_examples(tokenizer, articles, questions, d: DataSection, rng: np.random.Generator, with_response: bool,
                  max_len: int | None) -> list[tuple[block_rag.BlockExample, list[str]]]:
    """(example, gold answers) per usable question: gold + distractor passages, shuffled.

    Gold passages: the gold articles, or (``passage_unit="line"``) their lines that contain an answer.
    """
    pool = _passage_pool(articles, d.passage_unit)
    template = ({} if d.template == "paper" else {"system": COMPACT_SYSTEM, "last_format": COMPACT_LAST})
    out = []
    for q in questions:
        titles = set(q["titles"])
        gold = [i for i, p in enumerate(pool) if p["title"] in titles
                and (d.passage_unit == "article" or any(ans in p["text"] for ans in q["answer"]))]
        if q["hops"] > d.max_hops or not gold or len(gold) > d.passages:
            continue
        if d.questions == "lookup" and (len(q["answer"]) != 1 or q["question"].startswith("How many")):
            continue
        others = [i for i in range(len(pool)) if i not in set(gold)]
        picked = gold + list(rng.choice(others, size=min(d.passages - len(gold), len(others)), replace=False))
        rng.shuffle(picked)
        answer = ", ".join(q["answer"])
        try:
            ex = block_rag.build_rag_example(tokenizer, q["question"], [pool[i] for i in picked],
                                             answer if with_response else "",
                                             passages_per_block=d.passages_per_block, max_len=max_len, **template)
        except ValueError:  # longer than max_len: skipped, counted by the caller
            continue
        out.append((ex, list(q["answer"])))
    return out


def train_model(recipe: BlockRecipe, loss_fn: BlockLoss, examples, init_params, name: str):
    """Fine-tune from ``init_params`` (or the seeded random init) with the one trainer."""
    tc = recipe.train
    order = np.random.default_rng(tc.seed).permutation(len(examples))

    def batch(step):
        idx = [order[(step * tc.global_batch_size + i) % len(order)] for i in range(tc.global_batch_size)]
        return block_rag.collate([examples[i][0] for i in idx], recipe.data.seq_len)

    run_cfg = trainer.RunConfig(model=recipe.model, mesh=recipe.mesh, optimizer=recipe.optimizer,
                                train=tc)
    task = trainer.Task(loss_fn, batch, name=name, global_batch_size=tc.global_batch_size,
                        progress_keys=("loss_full", "loss_block"))
    result = trainer.run(run_cfg, task, init_params=init_params)
    return result.graphdef, jax.device_get(result.state.params)


def evaluate(graphdef, params, examples, tokenizer, marker_ids, recipe: BlockRecipe, mode: str) -> dict[str, float]:
    """Greedy answers under ``mode`` ("full" or "block") -> mean set EM / F1 and a sample output."""
    eos = tokenizer.token_to_id("<|end_of_text|>")
    # A fresh store per evaluation, so a fixed fingerprint cannot mix models.
    ba = BlockAttention((graphdef, params), store=KVStore(1 << 30), marker_ids=marker_ids, fingerprint="eval")
    ems, f1s, sample = [], [], None
    bs = recipe.eval.batch_size
    for i in range(0, len(examples), bs):
        chunk = examples[i:i + bs]
        out = ba.generate([[list(b) for b in ex.blocks] for ex, _ in chunk],
                          max_new_tokens=recipe.eval.max_new_tokens, mode=mode, eos_id=eos)
        for row, (_, gold) in zip(out, chunk):
            ids = row.tolist()
            ids = ids[:ids.index(eos)] if eos in ids else ids
            pred = tokenizer.decode(ids, skip_special_tokens=True).strip()
            scores = phantom_set_metrics(pred, gold)
            ems.append(scores["em"])
            f1s.append(scores["f1"])
            sample = sample or (pred, gold)
    return {"acc": 100 * float(np.mean(ems)), "f1": 100 * float(np.mean(f1s)), "sample": sample}


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval block_quality", description=__doc__)
    p.add_argument("--config", type=input_file, default=str(DEFAULT_CONFIG),
                   help="recipe YAML (train/configs/block_*.yaml)")
    p.add_argument("--model", type=input_dir, default=None,
                   help="start from this run folder or HF folder (with tokenizer.json); = init.hf_dir=PATH")
    p.add_argument("--out", type=output_file, default=None, help="write the result table as JSON here")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50 eval.questions=32")
    args = p.parse_args(argv)
    overrides = args.overrides + ([f"init.hf_dir={args.model}"] if args.model else [])
    recipe = config_lib.load_config(BlockRecipe, args.config, overrides)
    d = recipe.data
    timer = StageTimer()
    train_sets, eval_sets = load_universes(d, recipe.eval.questions)

    init_params = None
    if recipe.init.hf_dir:
        loaded = load_for_eval(recipe.init.hf_dir)
        if loaded.tokenizer is None:
            raise FileNotFoundError(f"init.hf_dir={recipe.init.hf_dir!r} has no tokenizer.json")
        model_cfg = loaded.config
        recipe = dataclasses.replace(recipe, model=model_cfg.replace(max_seq_len=max(model_cfg.max_seq_len,
                                                                                     d.seq_len)))
        init_params, tokenizer = nnx.state(loaded.model), loaded.tokenizer
    else:
        # Unlabelled text only: all article texts (evaluation universe included, so its new names are not
        # split into bytes), training questions, and the template strings.
        texts = [a["text"] for arts, _ in train_sets + eval_sets for a in arts]
        texts += [q["question"] for _, qs in train_sets for q in qs]
        texts += [COMPACT_SYSTEM, COMPACT_LAST, block_rag.RAG_SYSTEM, block_rag.RAG_LAST, block_rag.RAG_PASSAGE] * 50
        tokenizer = train_bpe(texts, d.vocab_size, special_tokens=SPECIAL_TOKENS)
        recipe = dataclasses.replace(recipe, model=recipe.model.replace(vocab_size=max(recipe.model.vocab_size,
                                                                                       tokenizer.get_vocab_size())))
    marker_ids = tuple(block_rag.encode(tokenizer, Markup(block_rag.BLOCK_MARKER))) if recipe.objective.marker else ()

    rng = np.random.default_rng(recipe.train.seed)
    train_examples = [ex for arts, qs in train_sets for ex in make_examples(tokenizer, arts, qs, d, rng, True,
                                                                            d.seq_len - len(marker_ids))]
    eval_max = recipe.model.max_seq_len - recipe.eval.max_new_tokens - len(marker_ids)
    eval_examples = [ex for arts, qs in eval_sets
                     for ex in make_examples(tokenizer, arts, qs, d, rng, False, eval_max)]
    eval_examples = eval_examples[:recipe.eval.questions]
    if not train_examples or not eval_examples:
        raise SystemExit(f"error: {len(train_examples)} training / {len(eval_examples)} evaluation examples; "
                         "raise data.seq_len or data.max_hops, or lower data.passages")
    print(f"data: {len(train_examples)} training examples, {len(eval_examples)} evaluation questions, "
          f"{d.passages} passages each, vocab {tokenizer.get_vocab_size()}, "
          f"mean prompt {np.mean([len(ex.prompt) for ex, _ in eval_examples]):.0f} tokens "
          f"({timer.total()[0]:.0f}s)", flush=True)

    if recipe.init.base_steps:
        base = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=recipe.init.base_steps,
                                                                     seed=recipe.train.seed + 1))
        _, init_params = train_model(base, BlockLoss(full_weight=1.0, block_weight=0.0), train_examples,
                                     init_params, "base")
    o = recipe.objective
    runs = {"full-FT": (BlockLoss(full_weight=1.0, block_weight=0.0), ()),
            "block-FT": (BlockLoss(o.full_weight, o.block_weight, marker_ids), marker_ids)}
    results = {}
    for name, (loss_fn, run_marker) in runs.items():
        graphdef, params = train_model(recipe, loss_fn, train_examples, init_params, name)
        results[name] = {mode: evaluate(graphdef, params, eval_examples, tokenizer, run_marker, recipe, mode)
                         for mode in ("full", "block")}
        seen = [(block_rag.BlockExample(ex.blocks), gold) for ex, gold in train_examples[:recipe.eval.train_questions]]
        if seen:
            results[name]["train_full"] = evaluate(graphdef, params, seen, tokenizer, run_marker, recipe, "full")
    print(f"\nPhantomWiki QA, {len(eval_examples)} held-out questions, set EM (F1) in %; "
          f"{recipe.init.base_steps} shared full-attention base steps, then {recipe.train.steps} fine-tuning "
          f"steps x {recipe.train.global_batch_size} examples per model:")
    print(table(["model", "full inference", "block inference", "block - full", "training questions (full)"],
                [[name, f"{r['full']['acc']:.1f} ({r['full']['f1']:.1f})",
                  f"{r['block']['acc']:.1f} ({r['block']['f1']:.1f})", r["block"]["acc"] - r["full"]["acc"],
                  r["train_full"]["acc"] if "train_full" in r else "-"] for name, r in results.items()],
                floatfmt=(".1f", ".1f", ".1f", "+.1f", ".1f")))
    gap = results["block-FT"]["block"]["acc"] - results["full-FT"]["full"]["acc"]
    print(f"block-FT in block mode vs full-FT in full mode: {gap:+.1f} points (paper -1.3; goal >= -2)")
    print(f"sample (block-FT, block mode): {results['block-FT']['block']['sample']}  "
          f"[{timer.total()[0]:.0f}s total]")
    if args.out:
        write_text(args.out, json.dumps(results, indent=1))
    return 0
