"""`rag-jax demo` end to end at toy size, its config loading, and the CLI's answers to bad input.

The end-to-end run is checked against independent references: answers are recomputed from the
article text with a regex, the report's GRIT recall is recomputed from the saved run folder with a
NumPy brute-force search and hand-written recall, and the metrics JSON equals the returned report.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rag_jax import cli
from rag_jax.recipes import rag_demo as demo
from rag_jax.data import phantom_rag
from rag_jax.evaluation import rag as rag_eval

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train" / "configs" / "demo_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cfg = demo.load_demo_config(TINY)
    lines = []
    report = demo.run(cfg, out_dir=out, progress=False, log=lines.append)
    return cfg, out, report, lines


def test_tiny_demo_writes_report_plots_and_checkpoint(tiny_run):
    cfg, out, report, lines = tiny_run
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["qa"]["conditions"] == json.loads(json.dumps(report["qa"]["conditions"]))
    for name in ("loss.png", "ttft.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == cfg.train.steps
    assert {"config.yaml", "tokenizer.json", "checkpoints"} <= {p.name for p in out.iterdir()}  # a run folder
    assert set(report["qa"]["conditions"]) == {"no_retrieval", "retrieval_full", "retrieval_block", "oracle_block"}
    for scores in report["qa"]["conditions"].values():
        assert all(0.0 <= scores[m] <= 1.0 for m in ("em", "f1", "subspan_em", "set_em", "set_f1"))
    for res in report["retrieval"].values():
        recalls = [res[f"recall@{k}"] for k in cfg.retrieval.ks]
        assert recalls == sorted(recalls) and 0.0 <= recalls[0] and recalls[-1] <= 1.0
    # Passage blocks were computed once and then reused from the KV store.
    kv = report["qa"]["kv_store"]
    assert kv["misses"] == kv["entries"] > 0 and kv["hits"] > 0
    assert [r["passages"] for r in report["ttft"]] == list(cfg.eval.ttft_passages)
    text = "\n".join(lines)
    assert "rag-jax demo report" in text and "recall@5" in text and "Block-Attention (KV reuse)" in text


def test_tiny_demo_data_are_attribute_questions_answered_by_their_article():
    cfg = demo.load_demo_config(TINY)
    data = phantom_rag.prepare_data(cfg.universe, cfg.task)
    arts: dict[str, str] = {}
    for p in data.eval_passages:
        arts[p["title"]] = arts.get(p["title"], "") + "\n" + p["text"]
    assert data.question_kind == "attribute" and len(data.eval_questions) > 10
    names = {"date of birth", "occupation", "hobby", "gender"}
    for q in data.eval_questions:
        m = re.fullmatch(r"What is the (.+) of (.+)\?", q["question"])
        assert m and m.group(1) in names and q["titles"] == [m.group(2)]
        written = re.search(rf"^The {m.group(1)} of {re.escape(m.group(2))} is (.+)\.$", arts[m.group(2)], re.M)
        assert q["answer"] == [written.group(1)]
    # The held-out universe shares no article with the training one.
    assert not {p["title"] for p in data.train_passages} & set(arts)


def test_rag_prompt_blocks_decode_to_passages_and_question():
    from rag_jax.tokenizer import BOS, EOS, PAD, train_bpe
    tok = train_bpe(["# Ada Lee\nThe hobby of Ada Lee is chess.\n", "Question: What is it?\nAnswer:"] * 5, 300,
                    special_tokens=(PAD, BOS, EOS, "<unk>"))
    ex = phantom_rag.rag_example(tok, "What is the hobby of Ada Lee?", ["# Ada Lee\nhobby chess\n", "# Bo\nx\n"], "chess")
    decoded = [tok.decode(list(b)) for b in ex.blocks]
    assert decoded == ["# Ada Lee\nhobby chess\n", "# Bo\nx\n", "Question: What is the hobby of Ada Lee?\nAnswer:"]
    assert ex.response[-1] == tok.token_to_id(EOS) and tok.decode(list(ex.response)) == " chess"


def test_score_answer_hand_computed():
    s = rag_eval.score_answer("Ada Lee, bo", ["Ada Lee", "Bo", "Cy"])
    assert s["set_em"] == 0.0 and s["set_f1"] == pytest.approx(2 * (2 / 2) * (2 / 3) / (1 + 2 / 3))
    assert s["em"] == 0.0 and s["subspan_em"] == 0.0
    s = rag_eval.score_answer("the Eiffel Tower!", ["Eiffel Tower", "Paris"], golds_are_set=False)
    assert s["em"] == 1.0 and s["set_em"] == 0.0


def test_prompt_passages_rank_reverse_and_gold_first_oracle():
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print("seed", seed)                                             # shown when it fails
    rng = np.random.default_rng(seed)
    ranked = rng.permutation(40)
    ranked[rng.integers(6, 40)] = -1                                # a padded slot deep in the list is skipped
    gold = [int(ranked[int(rng.integers(8, 30))]), int(ranked[1])]  # one gold retrieved low, one at rank 2
    gold = [g if g >= 0 else int(ranked[3]) for g in gold]
    k = 5
    rank = rag_eval.prompt_passages(ranked, gold, k, "rank")
    assert rank["retrieval"] == [int(j) for j in ranked[:k]]
    others = [int(j) for j in ranked if j >= 0 and j not in gold][:k - len(gold)]
    assert rank["oracle"] == gold + others                            # a retriever that ranks the gold first
    rev = rag_eval.prompt_passages(ranked, gold, k, "reverse")
    assert rev["retrieval"] == rank["retrieval"][::-1] and rev["oracle"][-len(gold):] == gold[::-1]
    assert rag_eval.with_gold([5, -1, 6, 7], [6, 6], 3) == [6, 5, 7]          # repeats dropped, -1 skipped
    with pytest.raises(ValueError, match="'sorted'; valid: rank, reverse"):
        rag_eval.prompt_order([1, 2], "sorted")
    with pytest.raises(ValueError, match="eval.passage_order='sorted'"):
        demo.load_demo_config(None, ["eval.passage_order=sorted"])
    assert demo.load_demo_config(None).eval.passage_order == "rank"                 # the tiny reader: as ranked
    assert demo.load_demo_config(None, real_model=True).eval.passage_order == "reverse"


def test_config_defaults_survive_partial_overrides():
    cfg = demo.load_demo_config(None, ["base=null", "model.num_layers=3", "optimizer.learning_rate=0.01",
                                       "train.steps=7"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (3, demo.DEMO_MODEL["hidden_size"])
    assert cfg.optimizer.learning_rate == 0.01 and cfg.optimizer.warmup_steps == demo.DEMO_OPTIMIZER["warmup_steps"]
    assert cfg.train.steps == 7 and cfg.retrieval.ks == (1, 2, 5, 10)
    assert cfg.train.log_every == demo.DEMO_TRAIN["log_every"]          # the demo's trainer defaults kept
    assert demo.load_demo_config(None, ["base=null", "model.preset=tiny"]).model.hidden_size == 64  # the preset
    assert demo.load_demo_config(None).base == demo.DEFAULT_BASE


def test_config_train_is_the_trainers_section_and_joint_the_jobs():
    """``train`` is the one trainer's ``TrainConfig`` (its fields pass through, validated there); the GRIT +
    Block-Attention fields are the ``joint`` section; trainer fields the demo sets itself are refused."""
    from rag_jax.train.trainer import TrainConfig
    cfg = demo.load_demo_config(None, ["train.remat_policy=full", "train.seed=3", "joint.rag_batch_size=16"])
    assert isinstance(cfg.train, TrainConfig) and (cfg.train.remat_policy, cfg.train.seed) == ("full", 3)
    assert cfg.joint.rag_batch_size == 16 and cfg.joint.embedding_batch_size == 8
    with pytest.raises(ValueError, match="unknown config key 'train.rag_batch_size'"):
        demo.load_demo_config(None, ["train.rag_batch_size=16"])
    with pytest.raises(ValueError, match="train.remat_policy='most'"):
        demo.load_demo_config(None, ["train.remat_policy=most"])
    for key, value in (("global_batch_size", 16), ("objective", "lm_causal"), ("run_dir", "x"), ("grad_accum_steps", 2)):
        with pytest.raises(ValueError, match=f"train.{key}=.*remove it"):
            demo.load_demo_config(None, [f"train.{key}={value}"])
    with pytest.raises(ValueError, match="joint.group_size=0 must be >= 1"):
        demo.load_demo_config(None, ["joint.group_size=0"])


def test_config_base_fixes_model_and_tokenizer():
    from rag_jax.config import ConfigError
    for override in ("model.num_layers=3", "tokenizer.vocab_size=512"):
        with pytest.raises(ConfigError, match="base=null"):
            demo.load_demo_config(None, [override])


def test_cli_missing_base(capsys, tmp_path):
    err = _cli_error(capsys, ["demo", f"base={tmp_path / 'no_base'}", "--out", str(tmp_path / "o")])
    assert "no_base" in err and "no such folder" in err and "base=null" in err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    err = _cli_error(capsys, ["demo", f"base={tmp_path / 'half'}", "--out", str(tmp_path / "o")])
    assert "tokenizer.json" in err and "safetensors" in err


def _cli_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rag-jax: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_cli_unknown_config_key(capsys):
    err = _cli_error(capsys, ["demo", "train.stepz=3"])
    assert "unknown config key 'train.stepz'" in err and "train.steps" in err
    assert "does not exist" in _cli_error(capsys, ["demo", "--config", "/nonexistent/demo.yaml"])
    assert "must be an int" in _cli_error(capsys, ["demo", "train.steps=many"])


def test_cli_missing_dataset(capsys, tmp_path):
    err = _cli_error(capsys, ["demo", "--data", str(tmp_path / "no_such_folder"), "--out", str(tmp_path / "o")])
    assert "no_such_folder" in err and "not found" in err


def test_cli_malformed_dataset(capsys, tmp_path):
    folder = tmp_path / "pw"
    folder.mkdir()
    (folder / "articles.json").write_text('[{"title": "A", "article": "x", "facts": []}')
    (folder / "questions.json").write_text("[]")
    err = _cli_error(capsys, ["demo", "--data", str(folder), "--out", str(tmp_path / "o")])
    assert "articles.json is not valid JSON" in err
    (folder / "articles.json").write_text('[{"title": "A", "facts": []}]')
    assert "has no field 'article'" in _cli_error(capsys, ["demo", "--data", str(folder), "--out", str(tmp_path / "o")])


def test_cli_unwritable_output_dir(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    err = _cli_error(capsys, ["demo", "--out", str(blocker / "out")])
    assert "is not writable" in err and "a_file" in err


def test_console_entry_point_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rag_jax", "demo", "--data", str(tmp_path / "missing"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("rag-jax: error: PhantomWiki folder")


def test_packaged_base_reads_a_held_out_universe():
    """The shipped reader base (``train/pretrain_reader.py``) answers attribute questions about people it has
    never seen (the demo's held-out universe, seed 1) from their gold passage, and cannot without it."""
    from rag_jax.data.phantom import generate_universe
    from rag_jax.tokenizer import load_tokenizer
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.model.hf import load_hf

    path = demo.resolve_base(demo.DEFAULT_BASE)
    info = json.loads((path / "reader.json").read_text())
    u_cfg = demo.load_demo_config(None).universe     # the demo's training and held-out universes
    assert not {u_cfg.seed, u_cfg.seed + 1} & set(info["train_seeds"]), info["train_seeds"]
    tok = load_tokenizer(path / "tokenizer.json")
    _, model, _ = load_hf(path)
    u = generate_universe(100, 1, max_hops=1, num_questions=400)
    passages = phantom_rag.article_passages(u.articles)
    qs = phantom_rag.select_questions(u.questions, passages, "attribute", 1, 1)[:40]
    ba = BlockAttention(model)

    def em(with_passage: bool) -> float:
        prompts = [list(phantom_rag.rag_example(tok, q["question"], [passages[q["gold"][0]]["text"]] if with_passage
                                         else []).blocks) for q in qs]
        preds = rag_eval.generate_answers(ba, tok, prompts, mode="block", max_new_tokens=12, batch_size=64)
        return float(np.mean([rag_eval.score_answer(p, q["answer"])["set_em"] for p, q in zip(preds, qs)]))

    with_passage, without = em(True), em(False)
    assert with_passage >= 0.8 and without <= 0.3, (with_passage, without)
