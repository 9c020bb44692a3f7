"""``rag-jax demo``: the whole framework end to end on a fictional universe, in minutes on a laptop CPU.

Pipeline (every stage is the project's own component; this module is only the glue):

1. **Data**: a PhantomWiki-style universe (``rag_jax.data.phantom.generate_universe``) for training and
   a second, held-out universe (seed + 1: new people, new facts) for evaluation; or, with
   ``--data PATH``, one PhantomWiki-format folder (``rag_jax.data.loaders.load_phantomwiki``) whose
   questions are split into train / held-out. The default task is 1-hop attribute questions
   ("What is the hobby of Ada Lee?"), whose answer is a span of the person's article: a small reader
   copies it from the retrieved text, and cannot guess it without retrieval (beyond the gender).
   Articles are cut into passages, one per section (``# Name`` + ``## Family`` / ``## Friends`` /
   ``## Attributes``), the usual RAG chunking: a question's gold passages are the sections that state
   the facts its Prolog query reads.
2. **Base model and tokenizer**: by default the packaged reader base ``demo_reader`` (an HF-format folder
   in ``rag_jax/assets/``, made by ``train/pretrain_reader.py`` on universes the demo never uses: seeds 100+),
   as GritLM and Block-Attention start from pretrained LMs. A model trained from scratch in this CPU budget
   does not learn to read (held-out exact match stays at the ~0.15 of guessing the gender), so the base
   brings that skill and the demo fine-tunes it. ``base: <folder>`` takes any HF-format folder with a
   ``tokenizer.json``; ``base: null`` trains a byte-level BPE tokenizer on the training texts
   (``rag_jax.data.tokenizer.train_bpe``) and a randomly initialized ``model`` (the GPU config does).
3. **Training**, one jitted step (``rag_jax.train.step``) with the GRIT objective (GritLM, ICLR 2025,
   Eq. 3: ``L = L_Rep + λ·L_Gen``), where
   - ``L_Rep`` is GRIT's contrastive loss over (question, gold passage, hard negatives: the person's
     other sections and passages that mention them) in bidirectional embedding mode (``rag_jax.train.objectives.grit.GritLoss``, ``mode="embedding"``);
   - ``L_Gen`` is the Block-Attention fine-tuning loss (Block-Attention, ICLR 2025, §2.2-2.4;
     ``rag_jax.train.objectives.block.BlockLoss``) on RAG prompts ``[passage blocks..., question
     block] -> answer``, each row trained in full and in block mode. Because the model is small (and
     may start from random weights), passage tokens also carry a next-token
     loss with weight ``train.lm_weight`` relative to answer tokens (the objective's ``loss_mask`` is a
     per-token weight). Question tokens carry none: their ``Question:`` -> `` What`` pattern would
     otherwise be what the model says after ``Answer:``.
4. **Retrieval**: the held-out passages are embedded with pretrained MiniLM
   (``rag_jax.retrieval.embedders.BertEmbedder``) and with the trained model in GRIT embedding mode
   (``rag_jax.model.embedding.GritEmbedder``), each into a ScaNN index
   (``rag_jax.retrieval.scann_index.ScannIndex``); recall@k / hit@k of the gold passages.
5. **Answers** to held-out questions (greedy): without retrieval; with the top-k retrieved passages
   under full attention; the same prompts under Block-Attention with passage KV reuse
   (``rag_jax.inference.block_attention.BlockAttention`` over a ``KVStore``); and with the gold
   passage(s) forced into the top k (reader upper bound). Scores: PhantomWiki's set exact match and
   set-F1 (``rag_jax.metrics.phantom_set_metrics``).
6. **TTFT** of full prefill vs Block-Attention with warm passage caches, by prompt length.
7. **Report**: ``metrics.json``, ``loss.png``, ``ttft.png``, ``metrics.jsonl`` (+ TensorBoard), and
   the checkpoint (orbax train state + ``tokenizer.json`` + resolved ``config.yaml``, loadable with
   :func:`load_checkpoint`), all under the output folder.

Configuration: :class:`DemoConfig` (defaults = the CPU demo), a YAML file (``--config``,
e.g. ``train/configs/demo_gpu.yaml``) and ``key=value`` overrides, validated by ``rag_jax.config``
before anything runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rag_jax import config as config_lib
from rag_jax.model.config import ModelConfig
from rag_jax.retrieval.scann_index import ScannConfig
from rag_jax.sharding import MeshConfig
from rag_jax.train.optim import OptimizerConfig

__all__ = ["DemoConfig", "load_demo_config", "run", "load_checkpoint", "prepare_data", "DemoData",
           "rag_example", "question_block", "passage_text", "score_answer", "main"]

QUESTION_FORMAT = "Question: {question}\nAnswer:"
EOS, BOS, PAD = "<eos>", "<bos>", "<pad>"
ATTRIBUTE_PREDICATES = ("dob", "job", "hobby", "gender")
DEFAULT_BASE = "demo_reader"
ASSETS = Path(__file__).resolve().parent / "assets"
QUESTION_KINDS = ("auto", "attribute", "evidence", "all")
RETRIEVERS = ("grit", "minilm")

# Defaults of the sections whose dataclass defaults are not the demo's (a YAML/override that sets one
# field of these sections keeps the other demo defaults; ``model.preset`` replaces the model defaults).
DEMO_MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=1024)
DEMO_OPTIMIZER = dict(learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, min_lr_ratio=0.1)


# ---------------------------------------------------------------------------------------------
# Configuration.

@dataclasses.dataclass(frozen=True)
class UniverseConfig:
    """Generated universes (unused with ``--data``): training universe ``seed``, held-out ``seed + 1``.

    Attributes:
      num_people / num_questions: training universe size (PhantomWiki generator arguments).
      heldout_people / heldout_questions: held-out universe size.
      max_hops: questions have 1..max_hops predicates.
      seed: training universe seed.
      friend_degree / max_family_size: PhantomWiki's mean friend count and family-tree size.
    """

    num_people: int = 300
    num_questions: int = 2000
    heldout_people: int = 100
    heldout_questions: int = 800
    max_hops: int = 1
    seed: int = 0
    friend_degree: float = 3.0
    max_family_size: int = 50


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Which questions, and how many retrieved passages per prompt.

    Attributes:
      questions: ``attribute`` (1-hop "What is the <attribute> of <name>?"), ``evidence`` (every
        answer is written in the gold passages, which fit in ``num_passages``), ``all``, or ``auto``
        (attribute for generated universes, evidence with ``--data``).
      max_hops: keep questions with at most this many hops.
      num_passages: retrieved passages per prompt (k); each is one Block-Attention block.
      heldout_fraction: with ``--data``, the fraction of (selected) questions held out for evaluation.
      split_seed: seed of that split.
    """

    questions: str = "auto"
    max_hops: int = 2
    num_passages: int = 2
    heldout_fraction: float = 0.25
    split_seed: int = 0

    def __post_init__(self):
        if self.questions not in QUESTION_KINDS:
            raise ValueError(f"task.questions={self.questions!r}; valid: {QUESTION_KINDS}")
        if self.max_hops < 1 or self.num_passages < 1:
            raise ValueError(f"task.max_hops={self.max_hops} and task.num_passages={self.num_passages} must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"task.heldout_fraction={self.heldout_fraction} must be in (0, 1)")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Attributes: vocab_size: BPE vocabulary (>= 260); the model's ``vocab_size`` is set from it."""

    vocab_size: int = 1024


@dataclasses.dataclass(frozen=True)
class DemoTrainConfig:
    """Joint GRIT + Block-Attention training.

    Attributes:
      steps: optimizer steps.
      rag_batch_size: RAG prompts per step (Block-Attention loss, both modes).
      embedding_batch_size: GRIT queries per step (in-batch negatives + hard negatives).
      group_size: GRIT passages per query (1 positive + group_size - 1 hard negatives).
      seq_len: padded RAG row length in tokens; 0 = from the data (k passages of 90th-percentile length).
      query_max_len / passage_max_len: GRIT token limits incl. the format prefix; 0 = from the data
        (the longest training query; the 90th-percentile passage).
      lm_weight: next-token loss weight of passage tokens (answer tokens weigh 1, question tokens 0).
      max_turns: questions per RAG row (1 = only the inference layout; see ``_TrainingData``).
      full_weight / block_weight: Block-Attention loss weights of the full and block passes.
      gen_weight: λ_Gen of GRIT Eq. 3 (weight of the Block-Attention loss against L_Rep).
      grit_temperature: InfoNCE temperature (GritLM: 0.02; 0.05 trains more stably from scratch).
      grit_instruction: query instruction in GRIT embedding mode (documents get none).
      precision: ``fp32`` | ``bf16`` | ``bf16_pure`` (``rag_jax.train.step.apply_precision``).
      seed: init, data order and distractor sampling.
      devices: devices of the training mesh; 0 = 1 on CPU (fake CPU devices do not add compute),
        all devices on GPU/TPU.
      log_every: steps between loss-curve points.
    """

    steps: int = 200
    rag_batch_size: int = 8
    embedding_batch_size: int = 8
    group_size: int = 2
    seq_len: int = 0
    query_max_len: int = 0
    passage_max_len: int = 0
    lm_weight: float = 0.2
    max_turns: int = 6
    full_weight: float = 1.0
    block_weight: float = 1.0
    gen_weight: float = 1.0
    grit_temperature: float = 0.05
    grit_instruction: str = "Find the article that answers the question"
    precision: str = "fp32"
    seed: int = 0
    devices: int = 0
    log_every: int = 1

    def __post_init__(self):
        for name in ("steps", "rag_batch_size", "embedding_batch_size", "group_size", "log_every", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("seq_len", "query_max_len", "passage_max_len", "devices"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0 (0 = automatic)")
        for name in ("lm_weight", "full_weight", "block_weight", "gen_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """Attributes:
      retriever: the index that feeds the answering prompts: ``grit`` (the trained model) or ``minilm``.
      ks: cut-offs of the reported recall@k / hit@k.
      scann: ScaNN index parameters (``auto`` picks brute force below 20K passages).
    """

    retriever: str = "minilm"
    ks: tuple[int, ...] = (1, 2, 5, 10)
    scann: ScannConfig = dataclasses.field(default_factory=ScannConfig)

    def __post_init__(self):
        if self.retriever not in RETRIEVERS:
            raise ValueError(f"retrieval.retriever={self.retriever!r}; valid: {RETRIEVERS}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"retrieval.ks={self.ks!r} must be a non-empty list of ints >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Attributes:
      max_questions: held-out questions answered (the first ones of the held-out set).
      max_new_tokens: cap on generated answer tokens (the longest training answer + 2 is used below it).
      batch_size: prompts per generation call.
      ttft_passages: passages per prompt for the TTFT curve (sizes that exceed max_seq_len are skipped).
      ttft_repeats: timed runs per point (median reported, after one warm-up run).
    """

    max_questions: int = 100
    max_new_tokens: int = 32
    batch_size: int = 128
    ttft_passages: tuple[int, ...] = (1, 2, 4, 6)
    ttft_repeats: int = 5

    def __post_init__(self):
        for name in ("max_questions", "max_new_tokens", "batch_size", "ttft_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")
        if any(n < 1 for n in self.ttft_passages):
            raise ValueError(f"eval.ttft_passages={self.ttft_passages!r} must be ints >= 1 (may be empty)")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The whole demo (sections above; ``model`` is a ``ModelConfig`` whose ``vocab_size`` is replaced
    by the trained tokenizer's, ``optimizer`` an ``OptimizerConfig``, ``mesh`` a ``MeshConfig``).

    ``base``: the model to fine-tune (module docstring, stage 2): the name of a packaged base
    (``demo_reader``, in ``rag_jax/assets/``), or a path to an HF-format folder (``config.json``,
    ``*.safetensors``, ``tokenizer.json``); ``None`` (``base: null``) trains the tokenizer and a random
    ``model`` from scratch. With a base, the ``model`` and ``tokenizer`` sections must not be set (the base
    fixes both)."""

    base: str | None = DEFAULT_BASE

    universe: UniverseConfig = dataclasses.field(default_factory=UniverseConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEMO_MODEL))
    optimizer: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(**DEMO_OPTIMIZER))
    train: DemoTrainConfig = dataclasses.field(default_factory=DemoTrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_demo_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> DemoConfig:
    """Demo defaults <- YAML file <- ``key=value`` overrides (``rag_jax.config`` rules).

    Raises:
      rag_jax.config.ConfigError (a ValueError): missing/invalid YAML, unknown key (with the closest
        valid one), wrong type, key set twice, or a section's own validation error.
    """
    data = config_lib.load_yaml(path) if path is not None else {}
    nested, keys = config_lib.parse_overrides(list(overrides))
    user = _merge(data, nested)
    defaults: dict[str, Any] = {"optimizer": dict(DEMO_OPTIMIZER)}
    model_section = user.get("model")
    if not (isinstance(model_section, dict) and "preset" in model_section):
        defaults["model"] = dict(DEMO_MODEL)
    cfg = config_lib.from_dict(DemoConfig, _merge(defaults, user), _from_string=keys)
    fixed = [name for name in ("model", "tokenizer") if name in user]
    if cfg.base is not None and fixed:
        raise config_lib.ConfigError(
            f"{' and '.join(fixed)} section(s) set while base={cfg.base!r}: the base model fixes the architecture "
            "and tokenizer; remove them, or set base=null to train a tokenizer and model from scratch")
    return cfg


def resolve_base(base: str) -> Path:
    """The folder of ``DemoConfig.base``: a packaged base name (``rag_jax/assets/<name>``) or a path.

    Raises:
      FileNotFoundError: no such folder, or it lacks ``config.json``, a ``*.safetensors`` file or
        ``tokenizer.json``.
    """
    path = ASSETS / base if (ASSETS / base).is_dir() and "/" not in base else Path(base)
    packaged = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
    if not path.is_dir():
        raise FileNotFoundError(f"base={base!r}: no such folder; use a packaged base {packaged}, an HF-format "
                                "folder with tokenizer.json, or base=null (train from scratch)")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"base={base!r} ({path}) lacks {missing}; an HF-format folder with "
                                "tokenizer.json is needed")
    return path


# ---------------------------------------------------------------------------------------------
# Data.

# Article section that states each PhantomWiki query predicate (official article layout: # Name /
# ## Family / ## Friends / ## Attributes; union predicates as in rules_base.pl).
SECTION_OF_PREDICATE = {
    **{p: "Family" for p in ("sister", "brother", "mother", "father", "son", "daughter", "wife", "husband",
                             "parent", "child", "sibling", "married")},
    "friend": "Friends", **{p: "Attributes" for p in ATTRIBUTE_PREDICATES},
}


@dataclasses.dataclass
class DemoData:
    """Passages (``{"title", "section", "text"}``: one per article section) and questions
    (``{"id", "question", "answer": [str], "hops", "titles": [str], "gold": [passage index]}``) of the
    training and the held-out side; with ``--data`` both sides share one universe's passages."""

    source: str
    train_passages: list[dict]
    eval_passages: list[dict]
    train_questions: list[dict]
    eval_questions: list[dict]
    question_kind: str
    num_articles: tuple[int, int]


def split_article(title: str, article: str) -> list[dict]:
    """An article -> one passage per non-empty ``## Section``, each headed by the article's ``# Title``
    line (so a passage names its person). Text without sections is one passage."""
    parts = re.split(r"\n\s*\n(?=## )", article.strip())
    head = parts[0].strip() if parts[0].startswith("# ") else f"# {title}"
    out = []
    for part in parts[1:] if len(parts) > 1 else []:
        lines = part.strip().split("\n")
        if len(lines) > 1:
            out.append({"title": title, "section": lines[0][3:].strip(), "text": f"{head}\n{part.strip()}\n"})
    if not out:
        body = article.strip()
        out.append({"title": title, "section": "",
                    "text": (body if body.startswith("# ") else f"{head}\n{body}") + "\n"})
    return out


def _query_sections(q: dict) -> set[str] | None:
    """Sections that state the predicates of the question's Prolog query (None: unknown)."""
    query = (q.get("prolog") or {}).get("query")
    if not query:
        return None
    preds = {m for atom in query for m in re.findall(r"([a-z_]+)\(", atom)} - {"aggregate_all", "distinct"}
    sections = {SECTION_OF_PREDICATE.get(p) for p in preds}
    return None if None in sections else sections


def _is_attribute_question(q: dict) -> bool:
    """1-hop ``<attribute>("<name>", Y)``: the answer is the value written in that person's article."""
    query = (q.get("prolog") or {}).get("query") or []
    return len(query) == 1 and re.match(r'^\s*(%s)\(\s*"' % "|".join(ATTRIBUTE_PREDICATES), query[0]) is not None


def _answer_in(answer: str, text: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(answer) + r"(?![\w-])", text) is not None


def select_questions(questions: Sequence[dict], passages: Sequence[dict], kind: str, max_hops: int,
                     num_passages: int) -> list[dict]:
    """Questions of ``kind`` (``TaskConfig.questions``, resolved) with at most ``max_hops`` hops and gold
    titles naming existing articles, each with ``"gold"``: the passages that state the facts its query
    reads (the query predicates' sections of the gold articles; all their passages when the query is
    unknown). ``evidence`` also needs every answer written in those passages and at most
    ``num_passages`` of them."""
    by_title: dict[str, list[int]] = {}
    for i, p in enumerate(passages):
        by_title.setdefault(p["title"], []).append(i)
    out = []
    for q in questions:
        titles = q.get("titles")
        if not titles or q["hops"] > max_hops or any(t not in by_title for t in titles):
            continue
        if kind == "attribute" and not _is_attribute_question(q):
            continue
        sections = _query_sections(q)
        gold = [i for t in titles for i in by_title[t] if sections is None or passages[i]["section"] in sections]
        if not gold:
            continue
        if kind == "evidence":
            text = "\n".join(passages[i]["text"] for i in gold)
            if len(gold) > num_passages or not all(_answer_in(a, text) for a in q["answer"]):
                continue
        out.append({**q, "gold": gold})
    return out


def as_dicts(articles, questions) -> tuple[list[dict], list[dict]]:
    """``rag_jax.data.loaders`` records -> the plain dicts of ``generate_universe`` (the demo's format)."""
    arts = [{"title": a.title, "article": a.article} for a in articles]
    qs = [{"id": q.id, "question": q.question, "answer": list(q.answer), "hops": q.hops,
           "titles": list(q.titles) if q.titles is not None else None, "prolog": q.prolog} for q in questions]
    return arts, qs


def article_passages(articles: Sequence[dict]) -> list[dict]:
    """Every article's section passages (``split_article``), in article order."""
    return [p for a in articles for p in split_article(a["title"], a["article"])]


def prepare_data(cfg: DemoConfig, data_path: str | os.PathLike | None = None) -> DemoData:
    """Generate (or load) the universe(s), cut articles into passages, select and split the questions
    (module docstring, stage 1).

    Raises:
      FileNotFoundError: ``data_path`` (or one of its JSON files) does not exist.
      ValueError: a malformed dataset file (names the file, record and field), or too few questions
        of the selected kind for training and evaluation.
    """
    task = cfg.task
    if data_path is None:
        from rag_jax.data.phantom import generate_universe
        u = cfg.universe
        kind = "attribute" if task.questions == "auto" else task.questions
        common = dict(max_hops=u.max_hops, friend_degree=u.friend_degree, max_family_size=u.max_family_size)
        train_u = generate_universe(u.num_people, u.seed, num_questions=u.num_questions, **common)
        eval_u = generate_universe(u.heldout_people, u.seed + 1, num_questions=u.heldout_questions, **common)
        train_p, eval_p = article_passages(train_u.articles), article_passages(eval_u.articles)
        train_q = select_questions(train_u.questions, train_p, kind, task.max_hops, task.num_passages)
        eval_q = select_questions(eval_u.questions, eval_p, kind, task.max_hops, task.num_passages)
        source = (f"generated universes: train seed {u.seed} ({u.num_people} people), "
                  f"held-out seed {u.seed + 1} ({u.heldout_people} people)")
        counts = (len(train_u.articles), len(eval_u.articles))
    else:
        from rag_jax.data.loaders import load_phantomwiki
        kind = "evidence" if task.questions == "auto" else task.questions
        data = load_phantomwiki(data_path)
        articles, questions = as_dicts(data.articles, data.questions)
        train_p = eval_p = article_passages(articles)
        selected = select_questions(questions, train_p, kind, task.max_hops, task.num_passages)
        random.Random(task.split_seed).shuffle(selected)
        n_eval = max(1, round(len(selected) * task.heldout_fraction)) if selected else 0
        eval_q, train_q = selected[:n_eval], selected[n_eval:]
        source = f"PhantomWiki folder {data_path} ({len(articles)} articles, {len(questions)} questions)"
        counts = (len(articles), len(articles))
    if len(train_q) < 2 or not eval_q:
        raise ValueError(f"only {len(train_q)} training and {len(eval_q)} held-out questions of kind {kind!r} with "
                         f"<= {task.max_hops} hops (and <= task.num_passages={task.num_passages} gold passages); "
                         "set task.questions=all, raise task.max_hops or generate more questions")
    return DemoData(source, train_p, eval_p, train_q, eval_q, kind, counts)


# ---------------------------------------------------------------------------------------------
# Prompts.

def passage_text(title: str, text: str) -> str:
    """A passage from another corpus (e.g. NQ) in the demo's layout: ``# Title`` line, then the text."""
    return f"# {title}\n{text.strip()}\n"


def question_block(question: str) -> str:
    return QUESTION_FORMAT.format(question=question)


def rag_example(tokenizer, question: str, passages: Sequence[str], answer: str | None = None):
    """A ``BlockExample``: one block per passage, the question block last, response ``" " + answer + <eos>``
    (``rag_jax.data.block_rag.build_rag_example`` with the demo's minimal template; no system block)."""
    from rag_jax.data.block_rag import build_rag_example
    return build_rag_example(tokenizer, question, [{"title": "", "text": p} for p in passages],
                             response=" " + answer if answer else "", system="", passage_format="{text}",
                             last_format=QUESTION_FORMAT, response_suffix=EOS)


def turns_block(turns: Sequence[tuple[Sequence[int], Sequence[int]]], newline: Sequence[int],
                question: Sequence[int], room: int | None = None) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """The last block of a multi-turn RAG row: answered ``(question ids, answer ids)`` turns, each followed by
    ``newline``, then the open ``question``. Turns are added while they fit in ``room`` tokens (None: all).

    Returns ``(block ids, answer spans)``: each earlier answer's ``[start, end)`` within the block (loss targets).
    """
    last, spans = (), []
    for q, a in turns:
        piece = tuple(q) + tuple(a) + tuple(newline)
        if room is not None and len(piece) > room:
            break
        spans.append((len(last) + len(q), len(last) + len(q) + len(a)))
        last = last + piece
        room = None if room is None else room - len(piece)
    return last + tuple(question), spans


def weighted_rag_batch(rows, seq_len: int, *, answer_weight: float = 1.0, passage_weight: float = 0.0):
    """Collate ``(BlockExample, answer spans of its last block)`` rows (``block_rag.collate``) with a per-token
    ``loss_mask``: ``answer_weight`` on the response and the earlier answers, ``passage_weight`` on passage
    tokens (next-token loss on the documents), 0 on the question tokens."""
    from rag_jax.data.block_rag import collate
    batch = collate([ex for ex, _ in rows], seq_len)
    for r, (ex, spans) in enumerate(rows):
        start = sum(len(b) for b in ex.blocks[:-1])
        for a, b in spans:
            batch["loss_mask"][r, start + a:start + b] = 1.0
    passage = (batch["segment_ids"] > 0) & ~batch["is_global"]
    batch["loss_mask"] = np.where(batch["loss_mask"] > 0, answer_weight,
                                  np.where(passage, passage_weight, 0.0)).astype(np.float32)
    return batch


def answer_text(answers: Sequence[str]) -> str:
    """Answer set -> the response string (PhantomWiki's comma-separated form)."""
    return ", ".join(answers)


def score_answer(prediction: str, golds: Sequence[str], *, golds_are_set: bool = True) -> dict[str, float]:
    """EM / F1 / best-subspan EM (SQuAD-normalized, ``rag_jax.metrics``) and PhantomWiki set EM / set-F1.

    ``golds_are_set``: PhantomWiki answer sets (SQuAD metrics against the comma-joined set; set metrics
    against the set) or alternatives as in NQ (every metric = the best over the alternatives).
    """
    from rag_jax import metrics
    if golds_are_set:
        joined = answer_text(golds)
        s = metrics.phantom_set_metrics(prediction, list(golds))
        return {"em": metrics.exact_match(prediction, joined), "f1": metrics.f1_score(prediction, joined),
                "subspan_em": metrics.best_subspan_em(prediction, joined), "set_em": s["em"], "set_f1": s["f1"]}
    sets = [metrics.phantom_set_metrics(prediction, [g]) for g in golds]
    return {"em": metrics.exact_match(prediction, golds), "f1": metrics.f1_score(prediction, golds),
            "subspan_em": metrics.best_subspan_em(prediction, golds),
            "set_em": max(s["em"] for s in sets), "set_f1": max(s["f1"] for s in sets)}


def _mean_scores(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


# ---------------------------------------------------------------------------------------------
# Training.

@dataclasses.dataclass(frozen=True)
class GritBlockLoss:
    """GRIT Eq. 3 with the Block-Attention loss as ``L_Gen``: ``L_Rep + gen_weight · L_Block`` (module
    docstring, stage 3). Hashable (a static argument of the train step)."""

    grit: Any  # rag_jax.train.objectives.grit.GritLoss (mode="embedding")
    block: Any  # rag_jax.train.objectives.block.BlockLoss
    gen_weight: float = 1.0

    def __call__(self, model, batch, rng=None):
        from rag_jax.train.objectives.block import BLOCK_BATCH_KEYS
        from rag_jax.train.objectives.grit import EMBEDDING_KEYS
        loss_rep, rep = self.grit(model, {k: batch[k] for k in EMBEDDING_KEYS}, rng)
        loss_gen, gen = self.block(model, {k: batch[k] for k in BLOCK_BATCH_KEYS}, rng)
        loss = loss_rep + self.gen_weight * loss_gen
        return loss, {"loss": loss, "loss_rep": loss_rep, "rep_accuracy": rep["rep_accuracy"],
                      "loss_full": gen["loss_full"], "loss_block": gen["loss_block"], "gen_accuracy": gen["accuracy"]}


def hard_negatives(passages: Sequence[dict]) -> list[list[int]]:
    """Per passage: the passages a retriever confuses with it — the other sections of the same article,
    then other people's passages that mention its title (as family or friend). Linear in the text:
    titles are looked up by their first word at every word of every passage."""
    by_title: dict[str, list[int]] = {}
    for i, p in enumerate(passages):
        by_title.setdefault(p["title"], []).append(i)
    by_first: dict[str, list[str]] = {}
    for t in by_title:
        by_first.setdefault(t.split(" ", 1)[0], []).append(t)
    mentions: dict[str, list[int]] = {t: [] for t in by_title}
    for i, p in enumerate(passages):
        text, found = p["text"], set()
        for m in re.finditer(r"[^\s,.]+", text):
            for t in by_first.get(m.group(), ()):
                if t != p["title"] and text.startswith(t, m.start()):
                    found.add(t)
        for t in sorted(found):
            mentions[t].append(i)
    return [[j for j in by_title[p["title"]] if j != i] + mentions[p["title"]] for i, p in enumerate(passages)]


class _TrainingData:
    """Tokenized training set and the two step-indexed grain streams (GRIT triples, RAG block rows).

    A RAG row is ``[passage blocks..., last block] -> answer`` with the question's gold passage(s) among
    ``task.num_passages`` passages (hard negatives and random ones, shuffled: the retriever's top k at
    test time may miss the gold passage and has no fixed order). The last block may first hold up to
    ``train.max_turns - 1`` answered questions about the same passages (``Question: ...`` /
    ``Answer: ...<eos>`` turns, answer tokens weighted 1 like the response): more answers to learn from per encoded
    passage, which a model trained from scratch needs. Rows with a single question (the inference
    layout) are as frequent as any other turn count.
    """

    def __init__(self, cfg: DemoConfig, data: DemoData, tokenizer, fmt):
        import grain

        from rag_jax.data.block_rag import BlockExample, encode
        from rag_jax.data.grit import GritDataConfig, embedding_dataset

        tc, k = cfg.train, cfg.task.num_passages
        texts = [p["text"] for p in data.train_passages]
        tokens = [tuple(encode(tokenizer, t)) for t in texts]
        lengths = np.asarray([len(t) for t in tokens])
        negatives = hard_negatives(data.train_passages)
        q_tokens = [tuple(encode(tokenizer, question_block(q["question"]))) for q in data.train_questions]
        a_tokens = [tuple(encode(tokenizer, " " + answer_text(q["answer"]) + EOS)) for q in data.train_questions]
        newline = tuple(encode(tokenizer, "\n"))
        q_len, a_len = max(map(len, q_tokens)), max(map(len, a_tokens))
        self.answer_tokens = a_len
        p90 = int(np.percentile(lengths, 90))
        turn = int(np.percentile([len(x) + len(y) for x, y in zip(q_tokens, a_tokens)], 90)) + len(newline)
        self.seq_len = tc.seq_len or -(-(k * p90 + q_len + a_len + (tc.max_turns - 1) * turn) // 32) * 32
        prefix = len(encode(tokenizer, fmt.embed_prefix("")))
        self.passage_max_len = tc.passage_max_len or -(-(p90 + prefix) // 16) * 16
        longest = max(len(encode(tokenizer, fmt.embed_prefix(tc.grit_instruction) + q["question"]))
                      for q in data.train_questions)
        self.query_max_len = tc.query_max_len or -(-longest // 8) * 8
        budget = self.seq_len - q_len - a_len
        keep = [j for j, q in enumerate(data.train_questions) if lengths[q["gold"]].sum() <= budget]
        self.questions = [data.train_questions[j] for j in keep]
        q_tokens, a_tokens = [q_tokens[j] for j in keep], [a_tokens[j] for j in keep]
        if len(self.questions) < max(2, tc.embedding_batch_size):
            raise ValueError(f"only {len(self.questions)} training questions fit train.seq_len={self.seq_len} tokens "
                             f"with their gold passages; need >= {max(2, tc.embedding_batch_size)} "
                             "(raise train.seq_len or lower train.embedding_batch_size)")
        self.dropped = len(data.train_questions) - len(self.questions)
        by_passage: dict[int, list[int]] = {}
        for j, q in enumerate(self.questions):
            for g in q["gold"]:
                by_passage.setdefault(g, []).append(j)
        lm_weight, max_turns = tc.lm_weight, tc.max_turns

        def rag_row(j: int, rng: np.random.Generator):
            q = self.questions[j]
            chosen, room = list(q["gold"]), budget - int(lengths[q["gold"]].sum())
            hard, rand = rng.permutation(negatives[q["gold"][0]]), rng.permutation(len(texts))
            candidates = [int(i) for pair in zip(hard, rand) for i in pair] + [int(i) for i in rand[len(hard):]]
            for i in candidates:
                if len(chosen) == k:
                    break
                if i not in chosen and lengths[i] <= room:
                    chosen.append(i)
                    room -= int(lengths[i])
            rng.shuffle(chosen)
            answerable = {o for i in chosen for o in by_passage.get(i, ()) if o != j
                          and set(self.questions[o]["gold"]) <= set(chosen)}
            others = rng.permutation(sorted(answerable))[:rng.integers(max_turns)]
            room = self.seq_len - int(lengths[chosen].sum()) - len(q_tokens[j]) - len(a_tokens[j])
            last, spans = turns_block([(q_tokens[o], a_tokens[o]) for o in others], newline, q_tokens[j], room)
            return BlockExample(tuple(tokens[i] for i in chosen) + (last,), a_tokens[j]), spans

        def rag_batch(rows):  # answers of the earlier turns are targets too; passage tokens weigh lm_weight
            return weighted_rag_batch(rows, self.seq_len, passage_weight=lm_weight)  # (module docstring, stage 3)

        self.rag = (grain.MapDataset.source(list(range(len(self.questions)))).shuffle(seed=tc.seed).repeat(None)
                    .random_map(rag_row, seed=tc.seed)
                    .batch(tc.rag_batch_size, drop_remainder=True, batch_fn=rag_batch))
        # GRIT negatives: the gold passage's hard negatives (same person, other sections; mentions) and as
        # many passages of the same section about other people. Without the latter, "which section"
        # separates positives from hard negatives and the embeddings collapse to the section type
        # (all Attributes passages alike: InfoNCE stalls at ln(batch)), losing the names.
        sections: dict[str, list[int]] = {}
        for i, p in enumerate(data.train_passages):
            sections.setdefault(p["section"], []).append(i)
        records = []
        shuffle = random.Random(tc.seed)
        for q in self.questions:
            g = q["gold"][0]
            hard = [i for i in negatives[g] if i not in q["gold"]]
            same = [i for i in sections[data.train_passages[g]["section"]] if i not in q["gold"]]
            negs = hard + shuffle.sample(same, min(len(same), max(len(hard), tc.group_size - 1)))
            if len(negs) < tc.group_size - 1:
                negs += shuffle.sample([i for i in range(len(texts)) if i not in q["gold"]], tc.group_size - 1)
            records.append({"query": [tc.grit_instruction, q["question"]], "pos": [texts[i] for i in q["gold"]],
                            "neg": [texts[i] for i in negs]})
        gcfg = GritDataConfig(embedding_batch_size=tc.embedding_batch_size, group_size=tc.group_size,
                              query_max_len=self.query_max_len, passage_max_len=self.passage_max_len, seed=tc.seed)
        self.grit = embedding_dataset(records, tokenizer, gcfg, fmt)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return {**self.grit[step], **self.rag[step]}


def _mesh(cfg: DemoConfig):
    import jax

    from rag_jax import sharding
    devices = jax.devices()
    n = cfg.train.devices or (1 if devices[0].platform == "cpu" else len(devices))
    if n > len(devices):
        raise ValueError(f"train.devices={n} but only {len(devices)} devices are available")
    return sharding.make_mesh(cfg.mesh, devices=devices[:n])


def _train(cfg: DemoConfig, model_cfg: ModelConfig, td: _TrainingData, mesh, progress: bool, log_dir: Path,
           init_params=None):
    """Run the joint objective from ``init_params`` (a base model's ``nnx.State``; None: random init); returns
    ``(graphdef, state, history rows, train seconds, compile seconds)``."""
    import jax
    from tqdm.auto import tqdm

    from rag_jax import sharding
    from rag_jax.train import metrics as metrics_lib
    from rag_jax.train import optim
    from rag_jax.train import step as step_lib
    from rag_jax.train.objectives.block import BlockLoss
    from rag_jax.train.objectives.grit import GritConfig, GritLoss

    tc = cfg.train
    for name, size in (("rag_batch_size", tc.rag_batch_size), ("embedding_batch_size", tc.embedding_batch_size)):
        try:
            sharding.check_global_batch(size, mesh)
        except ValueError as e:
            raise ValueError(f"train.{name}: {e}") from None
    loss_fn = GritBlockLoss(GritLoss(GritConfig(mode="embedding", temperature=tc.grit_temperature)),
                            BlockLoss(full_weight=tc.full_weight, block_weight=tc.block_weight), tc.gen_weight)
    tx = optim.make_optimizer(cfg.optimizer, tc.steps)
    schedule = optim.learning_rate_schedule(cfg.optimizer, tc.steps)
    graphdef, state, shardings = step_lib.init_train_state(model_cfg, tx, mesh, seed=tc.seed, params=init_params)
    train_step = step_lib.make_train_step(graphdef, tx, loss_fn, shardings, mesh, seed=tc.seed,
                                          learning_rate_fn=schedule)

    def device_batch(step):  # single-process: each array's leading (batch) axis over the data axes
        return {k: jax.device_put(v, sharding.batch_sharding(mesh, v.ndim)) for k, v in td.batch(step).items()}

    t0 = time.perf_counter()
    batch = device_batch(0)
    compiled = train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    (log_dir / "metrics.jsonl").unlink(missing_ok=True)  # the writer appends; a rerun starts a new curve
    writer = metrics_lib.MetricWriter(log_dir, jsonl=True, tensorboard=True)
    history = []
    t0 = time.perf_counter()
    with tqdm(total=tc.steps, desc="training (GRIT + Block-Attention)", unit="step", disable=not progress,
              dynamic_ncols=True) as bar:
        for step in range(1, tc.steps + 1):
            state, m = compiled(state, batch)
            if step < tc.steps:
                batch = device_batch(step)  # host work overlaps the running step
            if step % tc.log_every == 0 or step == tc.steps:
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                m["elapsed_s"] = time.perf_counter() - t0
                history.append({"step": step, **m})
                writer.write(step, m, prefix="train/")
                bar.set_postfix(loss=f"{m['loss']:.3f}", rep_acc=f"{m['rep_accuracy']:.2f}",
                                ans_acc=f"{m['gen_accuracy']:.2f}")
            bar.update(1)
    jax.block_until_ready(state)
    writer.close()
    return graphdef, state, history, time.perf_counter() - t0, compile_s


# ---------------------------------------------------------------------------------------------
# Checkpoint.

def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_checkpoint(folder: Path, cfg: DemoConfig, state, tokenizer) -> Path:
    """Orbax train state (``rag_jax.train.checkpoint``) + ``tokenizer.json`` + resolved ``config.yaml``,
    written into a temporary folder next to ``folder`` and renamed into place (atomic)."""
    import jax
    import yaml

    from rag_jax.atomic import replace_directory
    from rag_jax.data.tokenizer import save_tokenizer
    from rag_jax.train.checkpoint import CheckpointConfig, Checkpointer

    with replace_directory(folder) as tmp:
        step = int(jax.device_get(state.step))
        ckpt = Checkpointer(CheckpointConfig(dir=str(tmp / "orbax"), save_every=max(step, 1), keep=1, async_save=False))
        ckpt.save(step, state, force=True)
        ckpt.close()
        save_tokenizer(tokenizer, tmp / "tokenizer.json")
        (tmp / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
    return folder


def load_checkpoint(path: str | os.PathLike):
    """Load a demo checkpoint folder (``<out>/checkpoint``) on one device.

    Returns:
      ``(cfg: DemoConfig, graphdef, params, tokenizer)``; ``(graphdef, params)`` is the model for
      ``BlockAttention`` / ``GritEmbedder`` / ``generate``, ``nnx.merge(graphdef, params)`` the module.

    Raises:
      FileNotFoundError: the folder, its ``config.yaml``, ``tokenizer.json`` or orbax steps are missing.
      ValueError: an invalid ``config.yaml``.
    """
    import jax

    from rag_jax import sharding
    from rag_jax.data.tokenizer import load_tokenizer
    from rag_jax.train import optim
    from rag_jax.train import step as step_lib
    from rag_jax.train.checkpoint import CheckpointConfig, Checkpointer, abstract_with_shardings

    path = Path(path)
    for name in ("config.yaml", "tokenizer.json", "orbax"):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found; pass the checkpoint folder a demo run wrote "
                                    "(<out>/checkpoint, with config.yaml, tokenizer.json and orbax/)")
    cfg = load_demo_config(path / "config.yaml")
    tokenizer = load_tokenizer(path / "tokenizer.json")
    model_cfg = step_lib.apply_precision(cfg.model, cfg.train.precision)
    tx = optim.make_optimizer(cfg.optimizer, cfg.train.steps)
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    graphdef, abstract, specs = step_lib.abstract_train_state(model_cfg, tx, seed=cfg.train.seed)
    shardings = step_lib.train_state_shardings(abstract, specs, tx, mesh)
    ckpt = Checkpointer(CheckpointConfig(dir=str(path / "orbax"), async_save=False))
    try:
        restored = ckpt.restore_latest(abstract_with_shardings(abstract, shardings))
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{path / 'orbax'} holds no checkpoint step")
    return cfg, graphdef, restored[1].params, tokenizer


# ---------------------------------------------------------------------------------------------
# Retrieval, answering, TTFT.

def grit_format():
    """GRIT prompt strings with this project's BPE special tokens (``<bos>``/``<eos>``)."""
    from rag_jax.model.embedding import GritFormat
    return GritFormat(bos=BOS, eos=EOS)


def retrieval_eval(name: str, embed_docs, embed_queries, docs: Sequence[str], queries: Sequence[str],
                   gold: Sequence[Sequence[int]], hops: Sequence[int], ks: Sequence[int], scann: ScannConfig,
                   depth: int) -> tuple[np.ndarray, dict]:
    """Embed ``docs`` into a ScaNN index, search every query, score against its gold doc indices.

    Args:
      embed_docs / embed_queries: ``texts -> float32 [n, dim]`` unit-norm (the Embedder protocol).
      gold: per query, the indices of its relevant docs; hops: per query, for the per-hop breakdown.
      depth: results kept per query (>= max(ks)).

    Returns:
      ``(ranked doc indices int64 [q, depth'] (-1 = none), {"recall@k", "hit@k", "by_hops": {hops: {...}},
      "seconds", "num_docs", "retriever", "index"})``.
    """
    from rag_jax import metrics
    from rag_jax.retrieval.scann_index import ScannIndex

    t0 = time.perf_counter()
    vectors = embed_docs(list(docs))
    index = ScannIndex(vectors.shape[1], scann)
    index.add(vectors, np.arange(len(docs)))
    index.build()
    _, ranked = index.search(embed_queries(list(queries)), max(depth, *ks))

    def scores(sel):
        r, g = [ranked[i] for i in sel], [gold[i] for i in sel]
        out = {}
        for k in ks:
            out[f"recall@{k}"] = metrics.recall_at_k(r, g, k)
            out[f"hit@{k}"] = metrics.hit_at_k(r, g, k)
        out["num_questions"] = len(sel)
        return out

    result = scores(range(len(queries)))
    result["by_hops"] = {h: scores([i for i, x in enumerate(hops) if x == h]) for h in sorted(set(hops))}
    result.update(seconds=time.perf_counter() - t0, num_docs=len(docs), retriever=name, index=dict(index.params))
    return ranked, result


def generate_answers(block_attention, tokenizer, prompts: Sequence[Sequence[Sequence[int]]], *, mode: str,
                     max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers (text up to ``<eos>``) for block prompts via ``BlockAttention.generate``."""
    eos = tokenizer.token_to_id(EOS)
    rows = []
    for i in range(0, len(prompts), batch_size):
        out = block_attention.generate(prompts[i:i + batch_size], max_new_tokens=max_new_tokens, mode=mode,
                                       eos_id=eos)
        rows.extend(np.asarray(out).tolist())
    return [tokenizer.decode(r[:r.index(eos)] if eos in r else r, skip_special_tokens=True).strip() for r in rows]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, and for block mode the passage caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ttft_curve(block_attention, tokenizer, passages: Sequence[str], question: str, sizes: Sequence[int],
               repeats: int, progress: bool = False) -> list[dict]:
    """TTFT (ms, median) of one prompt with ``n`` passages for each ``n`` in ``sizes``: a full causal
    prefill vs Block-Attention prefill of the question block over warm passage caches (both up to the
    first token's logits). Sizes whose prompt exceeds ``max_seq_len`` (or the passages given) are skipped."""
    import jax
    from tqdm.auto import tqdm

    from rag_jax.data.block_rag import encode

    last = encode(tokenizer, question_block(question))
    rows = []
    for n in tqdm(sizes, desc="TTFT full vs cached", unit="size", disable=not progress):
        if n > len(passages):
            continue
        blocks = [encode(tokenizer, p) for p in passages[:n]] + [last]
        total = sum(len(b) for b in blocks)
        if total + 1 > block_attention.config.max_seq_len:
            continue
        full = _median_ms(lambda: jax.block_until_ready(block_attention.prefill(blocks, mode="full").logits), repeats)
        cached = _median_ms(lambda: jax.block_until_ready(block_attention.prefill(blocks, mode="block").logits),
                            repeats)
        rows.append({"passages": n, "prompt_tokens": total, "prefilled_tokens_cached": len(last),
                     "full_ms": full, "cached_ms": cached, "speedup": full / cached})
    return rows


# ---------------------------------------------------------------------------------------------
# Report.

def _plots(history: list[dict], ttft: list[dict], out: Path) -> dict[str, str]:
    from matplotlib.figure import Figure  # no pyplot: no global backend state (works in notebooks too)

    files = {}
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = [h["step"] for h in history]
    for key, label in (("loss", "total (L_Rep + λ·L_Gen)"), ("loss_rep", "GRIT L_Rep (contrastive)"),
                       ("loss_full", "Block-Attention loss, full pass"), ("loss_block", "Block-Attention loss, block pass")):
        ax.plot(steps, [h[key] for h in history], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title("rag-jax demo: training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    files["loss_plot"] = str(out / "loss.png")
    if ttft:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        x = [r["prompt_tokens"] for r in ttft]
        ax.plot(x, [r["full_ms"] for r in ttft], "o-", label="full prefill")
        ax.plot(x, [r["cached_ms"] for r in ttft], "o-", label="Block-Attention, cached passages")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("time to first token (ms, median)")
        ax.set_title("TTFT vs prompt length")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
        files["ttft_plot"] = str(out / "ttft.png")
    return files


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


CONDITION_LABELS = {
    "no_retrieval": "no retrieval (question only)",
    "retrieval_full": "retrieved top-{k}, full attention",
    "retrieval_block": "retrieved top-{k}, Block-Attention (KV reuse)",
    "oracle_block": "gold passage(s) in top-{k}, Block-Attention",
}


def format_report(report: dict) -> str:
    """The human-readable report printed at the end of a run."""
    d, tr, qa = report["data"], report["train"], report["qa"]
    k = qa["num_passages"]
    ks = report["config"]["retrieval"]["ks"]
    lines = ["", "=" * 78, "rag-jax demo report", "=" * 78,
             f"data: {d['source']}",
             f"task: {d['question_kind']} questions; {d['train_questions']} train / {d['eval_questions']} held-out; "
             f"articles cut into section passages: {d['train_passages']} train / {d['eval_passages']} held-out",
             f"model: {report['model']['num_layers']} layers, hidden {report['model']['hidden_size']}, "
             f"{report['model']['params'] / 1e6:.2f}M params, vocab {report['model']['vocab_size']}; "
             + (f"fine-tuned from base {report['model']['base']}" if report['model'].get('base') else "from scratch"),
             f"training: {tr['steps']} steps in {tr['seconds']:.0f} s (+{tr['compile_seconds']:.0f} s compile); final "
             f"loss {tr['final']['loss']:.3f}, GRIT in-batch top-1 {tr['final']['rep_accuracy']:.2f}, "
             f"next-token accuracy (loss-weighted) {tr['final']['gen_accuracy']:.2f}", ""]
    rows = [[r["retriever"], *[r[f"recall@{c}"] for c in ks], *[r[f"hit@{c}"] for c in ks]]
            for r in report["retrieval"].values()]
    lines += [f"retrieval of gold passages among {d['eval_passages']} held-out passages (ScaNN), "
              f"{d['eval_questions']} questions:",
              _table(["embedder", *[f"recall@{c}" for c in ks], *[f"hit@{c}" for c in ks]], rows), ""]
    rows = [[CONDITION_LABELS[c].format(k=k), v["set_em"], v["set_f1"], v["f1"], v["seconds"]]
            for c, v in qa["conditions"].items()]
    lines += [f"answers to {qa['num_questions']} held-out questions (retriever: {qa['retriever']}; greedy):",
              _table(["condition", "EM", "set-F1", "token-F1", "seconds"], rows)]
    kv = qa.get("kv_store")
    if kv:
        lines.append(f"passage KV store: {kv['entries']} cached blocks ({kv['bytes'] / 2**20:.1f} MiB), "
                     f"{kv['hits']} hits / {kv['misses']} misses")
    if report["ttft"]:
        rows = [[r["passages"], r["prompt_tokens"], r["full_ms"], r["cached_ms"], r["speedup"]] for r in report["ttft"]]
        lines += ["", "time to first token (ms, median; cached = Block-Attention with warm passage KV):",
                  _table(["passages", "tokens", "full ms", "cached ms", "speedup"], rows)]
    if qa.get("examples"):
        lines += ["", "examples (held-out):"]
        for ex in qa["examples"]:
            lines.append(f"  Q: {ex['question']}  gold: {answer_text(ex['gold'])}")
            lines.append(f"     no retrieval: {ex['no_retrieval']!r}   with retrieval (block): {ex['retrieval_block']!r}")
    lines += ["", "files: " + ", ".join(f"{k}={v}" for k, v in report["files"].items()),
              f"total: {report['total_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU; stages (wall/CPU s): "
              + ", ".join(f"{k} {v:.0f}/{report['cpu_timings'][k]:.0f}" for k, v in report["timings"].items()),
              "=" * 78]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The job.

def check_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and check a file can be written there (before any compute).

    Raises:
      PermissionError: the folder cannot be created or written (the message says why).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"output directory {str(path)!r} is not writable ({e.strerror or e}); "
                              "pass --out with a writable folder") from None
    return path


def with_gold(ranked: Sequence[int], gold: Sequence[int], k: int) -> list[int]:
    """The top-k retrieved passage indices with the gold ones forced in (replacing the lowest-ranked others)."""
    gold = [int(g) for g in gold[:k]]
    return [int(i) for i in ranked if i >= 0 and i not in gold][:k - len(gold)] + gold


def run(cfg: DemoConfig, *, data_path: str | os.PathLike | None = None, out_dir: str | os.PathLike = "runs/demo",
        progress: bool = True, log=print) -> dict:
    """Run the demo (module docstring) and return the report dict (also written to ``metrics.json``).

    Raises:
      PermissionError: ``out_dir`` is not writable. FileNotFoundError / ValueError: a missing or malformed
      ``data_path``, too few questions, or a missing MiniLM package while ``retrieval.retriever=minilm``.
      All are raised before any training.
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = check_output_dir(out_dir)
    base_dir = resolve_base(cfg.base) if cfg.base is not None else None
    from rag_jax.retrieval.embedders import minilm_dir
    try:
        minilm_dir()
        have_minilm = True
    except FileNotFoundError:
        if cfg.retrieval.retriever == "minilm":
            raise
        have_minilm = False
    timings: dict[str, float] = {}
    cpu_timings: dict[str, float] = {}
    cpu = [time.process_time()]

    def stage(name, t0):  # wall and CPU seconds of each stage (CPU time is what a busy machine does not inflate)
        timings[name] = time.perf_counter() - t0
        cpu_timings[name] = time.process_time() - cpu[0]
        cpu[0] = time.process_time()
        return time.perf_counter()

    t = time.perf_counter()
    log(f"[1/7] data: {'loading ' + str(data_path) if data_path else 'generating universes'}")
    data = prepare_data(cfg, data_path)
    t = stage("data", t)

    import jax

    from rag_jax.data.tokenizer import train_bpe
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.inference.kv_store import KVStore
    from rag_jax.model import count_params
    from rag_jax.model.embedding import GritEmbedder
    from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
    from rag_jax.train import step as step_lib

    fmt = grit_format()
    if base_dir is None:
        log(f"[2/7] tokenizer: byte-level BPE, vocab {cfg.tokenizer.vocab_size}; model from scratch")
        # The prompt and GRIT format strings are in every input: let BPE learn them as a few tokens.
        texts = ([p["text"] for p in data.train_passages] + [q["question"] for q in data.train_questions]
                 + [question_block("") + " " + answer_text(q["answer"]) for q in data.train_questions]
                 + [fmt.embed_prefix(cfg.train.grit_instruction), fmt.embed_prefix("")] * 8)
        tokenizer = train_bpe(texts, cfg.tokenizer.vocab_size, special_tokens=(PAD, BOS, EOS, "<unk>"))
        vocab = -(-tokenizer.get_vocab_size() // 64) * 64  # a multiple of 64: friendlier matmul shapes
        model_cfg, init_params = cfg.model.replace(vocab_size=vocab), None
    else:
        from flax import nnx

        from rag_jax.data.tokenizer import load_tokenizer
        from rag_jax.model.hf import load_hf
        log(f"[2/7] base model and tokenizer: {cfg.base} ({base_dir})")
        tokenizer = load_tokenizer(base_dir / "tokenizer.json")
        missing = [t for t in (PAD, BOS, EOS) if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"base={cfg.base!r}: tokenizer.json lacks the special tokens {missing} the demo's "
                             "prompts use")
        model_cfg, base_model, _ = load_hf(base_dir, dtype="float32")
        init_params = nnx.split(base_model)[1]
    td = _TrainingData(cfg, data, tokenizer, fmt)
    # The checkpoint's config is self-contained: the model actually trained, its tokenizer saved beside it.
    resolved = dataclasses.replace(cfg, base=None, model=model_cfg, train=dataclasses.replace(
        cfg.train, seq_len=td.seq_len, query_max_len=td.query_max_len, passage_max_len=td.passage_max_len),
        tokenizer=TokenizerConfig(vocab_size=tokenizer.get_vocab_size()))
    if td.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"train.seq_len={td.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; raise "
                         "model.max_seq_len or lower task.num_passages")
    t = stage("tokenizer", t)

    mesh = _mesh(cfg)
    params = count_params(model_cfg)
    log(f"[3/7] training: {params / 1e6:.2f}M-param model ({'fine-tuning ' + cfg.base if cfg.base else 'from scratch'}), {cfg.train.steps} steps, GRIT (contrastive, "
        f"{cfg.train.embedding_batch_size} queries x {cfg.train.group_size} passages) + Block-Attention "
        f"({cfg.train.rag_batch_size} prompts x {td.seq_len} tokens, full + block passes) on {mesh.size} device(s)")
    graphdef, state, history, train_s, compile_s = _train(
        cfg, step_lib.apply_precision(model_cfg, cfg.train.precision), td, mesh, progress, out, init_params)
    model = (graphdef, state.params)
    t = stage("train", t)

    log("[4/7] checkpoint (orbax)")
    ckpt_dir = _save_checkpoint(out / "checkpoint", resolved, state, tokenizer)
    t = stage("checkpoint", t)

    log("[5/7] retrieval: embed held-out passages, ScaNN index, recall@k")
    k = cfg.task.num_passages
    depth = max(max(cfg.retrieval.ks), k + 1)
    docs = [p["text"] for p in data.eval_passages]
    queries = [q["question"] for q in data.eval_questions]
    gold = [q["gold"] for q in data.eval_questions]
    hops = [q["hops"] for q in data.eval_questions]
    retrieval, ranked = {}, {}
    if have_minilm:
        minilm = BertEmbedder()
        ranked["minilm"], retrieval["minilm"] = retrieval_eval(
            "MiniLM-L6 (pretrained)", lambda x: embed_texts(minilm, x, desc="MiniLM passages", progress=progress),
            minilm.embed, docs, queries, gold, hops, cfg.retrieval.ks, cfg.retrieval.scann, depth)
    grit = GritEmbedder(model, tokenizer, max_length=td.passage_max_len, fmt=fmt)
    ranked["grit"], retrieval["grit"] = retrieval_eval(
        "GRIT (this model)", lambda x: embed_texts(grit, x, desc="GRIT passages", progress=progress),
        lambda x: grit.embed(x, instruction=cfg.train.grit_instruction),
        docs, queries, gold, hops, cfg.retrieval.ks, cfg.retrieval.scann, depth)
    t = stage("retrieval", t)

    log("[6/7] answering held-out questions: no retrieval / retrieval (full, block) / gold")
    questions = data.eval_questions[:cfg.eval.max_questions]
    use = ranked[cfg.retrieval.retriever]
    max_new = min(cfg.eval.max_new_tokens, td.answer_tokens + 2)
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    prompts = {
        "no_retrieval": [rag_example(tokenizer, q["question"], []).blocks for q in questions],
        "retrieval": [rag_example(tokenizer, q["question"], [docs[j] for j in use[i][:k] if j >= 0]).blocks
                      for i, q in enumerate(questions)],
        "oracle": [rag_example(tokenizer, q["question"], [docs[j] for j in with_gold(use[i], q["gold"], k)]).blocks
                   for i, q in enumerate(questions)],
    }
    conditions, predictions = {}, {}
    plan = [("no_retrieval", "no_retrieval", "full"), ("retrieval_full", "retrieval", "full"),
            ("retrieval_block", "retrieval", "block"), ("oracle_block", "oracle", "block")]
    from tqdm.auto import tqdm
    for name, which, mode in tqdm(plan, desc="answering", unit="condition", disable=not progress):
        t0 = time.perf_counter()
        preds = generate_answers(ba, tokenizer, prompts[which], mode=mode, max_new_tokens=max_new,
                                 batch_size=cfg.eval.batch_size)
        scores = _mean_scores([score_answer(p, q["answer"]) for p, q in zip(preds, questions)])
        conditions[name] = {**scores, "seconds": time.perf_counter() - t0, "mode": mode}
        predictions[name] = preds
    kv_store = {"entries": len(ba.store), "bytes": ba.store.nbytes, **ba.store.stats}
    t = stage("answers", t)

    log("[7/7] TTFT: full prefill vs cached passages")
    order = [int(j) for j in use[0] if j >= 0]
    order += [j for j in range(len(docs)) if j not in order]
    ttft = ttft_curve(ba, tokenizer, [docs[j] for j in order], questions[0]["question"], cfg.eval.ttft_passages,
                      cfg.eval.ttft_repeats, progress)
    t = stage("ttft", t)

    files = {"metrics": str(out / "metrics.json"), "checkpoint": str(ckpt_dir),
             "train_metrics": str(out / "metrics.jsonl"), **_plots(history, ttft, out)}
    report = {
        "config": config_lib.to_dict(resolved),
        "data": {"source": data.source, "question_kind": data.question_kind,
                 "train_questions": len(td.questions), "eval_questions": len(data.eval_questions),
                 "train_articles": data.num_articles[0], "eval_articles": data.num_articles[1],
                 "train_passages": len(data.train_passages), "eval_passages": len(data.eval_passages),
                 "train_questions_dropped_too_long": td.dropped},
        "model": {"params": params, "base": str(base_dir) if base_dir else None, **{f: getattr(model_cfg, f) for f in ("num_layers", "hidden_size", "num_heads",
                                                                          "num_kv_heads", "vocab_size")}},
        "train": {"steps": cfg.train.steps, "seconds": train_s, "compile_seconds": compile_s,
                  "seq_len": td.seq_len, "final": history[-1], "history": history},
        "retrieval": retrieval,
        "qa": {"num_questions": len(questions), "retriever": cfg.retrieval.retriever, "num_passages": k,
               "max_new_tokens": max_new, "conditions": conditions, "kv_store": kv_store,
               "examples": [{"question": q["question"], "gold": q["answer"],
                             **{c: predictions[c][i] for c in predictions}} for i, q in enumerate(questions[:3])]},
        "ttft": ttft,
        "devices": f"{mesh.size} x {jax.devices()[0].device_kind}",
        "files": files,
        "timings": timings,
        "cpu_timings": cpu_timings,
    }
    report["total_seconds"] = time.perf_counter() - wall0
    report["cpu_seconds"] = time.process_time() - cpu0
    _atomic_write(out / "metrics.json", json.dumps(report, indent=1, default=float))
    log(format_report(report))
    return report


def run_cli(args) -> int:
    """``rag-jax demo`` (arguments defined in ``rag_jax.cli``)."""
    cfg = load_demo_config(args.config, args.overrides)
    run(cfg, data_path=args.data, out_dir=args.out, progress=not args.no_progress)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rag_jax.demo ...`` = ``rag-jax demo ...``."""
    import sys

    from rag_jax.cli import main as cli_main
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
