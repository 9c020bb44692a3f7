"""DRAG / IterDRAG / RAGGED (rag_jax/recipes/rag_scaling): the oracle decomposition against an independent
evaluator of its sub-questions' text, the allocation model against float64 closed forms, RAGGED's scores against
hand-computed values, the runner's prompts and budgets with a recording model, and the eval end to end on a tiny
chat model (with its reply cache)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from rag_jax.data.chat_blocks import ChatBlocks
from rag_jax.data.phantom import _ATTRIBUTE_TEXT, RELATIONS, FactBase, generate_universe
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.load import LoadedModel
from rag_jax.recipes.rag_scaling import allocation, rag_scaling
from rag_jax.recipes.rag_scaling.decompose import (FINAL, gold_intermediate_answers, oracle_decomposition,
                                                   parse_self_ask, self_ask_text)
from rag_jax.recipes.rag_scaling.ragged import ragged_scores
from rag_jax.recipes.rag_scaling.runner import Runner, drag_demonstration
from rag_jax.tokenizer import byte_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "phantomwiki"
CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  max_seq_len=1024)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "<|im_start|>assistant\n")


def _tiny(seed=0, max_seq_len=1024):
    import dataclasses
    cfg = dataclasses.replace(CFG, max_seq_len=max_seq_len)
    return LoadedModel(cfg, Transformer(cfg, rngs=nnx.Rngs(seed)), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                       (10,), {"eos_token": "\n"}, Path("tiny-chat"))


# -- decomposition -----------------------------------------------------------------------------------------------
_PRED_OF_TEXT = {v: k for k, v in _ATTRIBUTE_TEXT.items()}


def _names(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def _who(facts, sub):
    """Evaluate "Who is the person whose A is V?" / "Who is the R of N1, N2?" from its words alone."""
    m = re.fullmatch(r"Who is the person whose (.+?) is (.+)\?", sub)
    if m:
        return sorted(set(facts.subjects(_PRED_OF_TEXT[m.group(1)], m.group(2))))
    m = re.fullmatch(r"Who is the ([\w-]+) of (.+)\?", sub)
    people = set(_names(m.group(2)))
    for pred in RELATIONS[m.group(1)][0]:
        people = {y for x in people for y in facts.objects(pred, x)}
    return sorted(people)


@pytest.mark.parametrize("source", ["generated", "depth10_seed1"])
def test_oracle_steps_answer_to_the_gold_chain(source):
    """Each sub-question, filled with the earlier steps' gold answers and evaluated from its text, gives the gold
    intermediate answers read off the Prolog query; h-hop questions of stated relations take h - 1 steps."""
    if source == "generated":
        seed = int(np.random.default_rng().integers(1 << 20))
        u = generate_universe(60, seed, max_hops=4, num_questions=80)
        articles, questions = u.articles, u.questions
    else:
        if not (SHARED / source).is_dir():
            pytest.skip(f"shared data {SHARED / source} absent")
        articles = json.loads((SHARED / source / "articles.json").read_text())
        questions = json.loads((SHARED / source / "questions.json").read_text())[:80]
    facts = FactBase.from_articles(articles)
    multi = 0
    for q in questions:
        dec = oracle_decomposition(q["question"])
        assert sum(dec.atoms) <= len(q["prolog"]["query"]) - 1           # the final phrase is left for the answer
        if source != "generated":                                          # stated relations only: one atom each
            assert len(dec.steps) == len(q["prolog"]["query"]) - 1
        golds = gold_intermediate_answers(facts, q["prolog"]["query"], dec)
        filled = []
        for step, gold in zip(dec.steps, golds):
            assert _who(facts, dec.fill(step, filled)) == sorted(gold), (q["question"], step)
            filled.append(", ".join(gold))
        assert "#" not in dec.fill(dec.final, filled) and dec.final.endswith("?")
        multi += bool(dec.steps)
    assert multi >= 10


def test_decomposition_text():
    dec = oracle_decomposition("How many sons does the friend of the person whose hobby is shogi have?")
    assert dec.steps == ("Who is the person whose hobby is shogi?", "Who is the friend of #1?")
    assert dec.final == "How many sons does #2 have?" and dec.atoms == (1, 1)
    assert dec.fill(dec.final, ["A B", "C D, E F"]) == "How many sons does C D, E F have?"
    assert oracle_decomposition("What is the hobby of the grandmother of Ann Lee?").atoms == (2,)
    assert oracle_decomposition("Who is the friend of Ann Lee?").steps == ()


def test_self_ask_format_round_trip():
    chain = self_ask_text(["Who is the friend of Ann?"], ["Bo Lee"], "chess")
    assert chain == "Follow up: Who is the friend of Ann?\nIntermediate answer: Bo Lee\nSo the final answer is: chess"
    assert parse_self_ask(" Follow up: Who is X?\nIntermediate answer: Y") == ("follow_up", "Who is X?")
    assert parse_self_ask("blah\nSo the final answer is: Zed Q\nmore") == ("final", "Zed Q")
    assert parse_self_ask("Ann Lee.\nOther") == ("final", "Ann Lee.")


# -- allocation model --------------------------------------------------------------------------------------------
def _grid(rng, n=30):
    return rng.integers(0, 40, n), rng.integers(0, 9, n), rng.integers(1, 4, n)


def test_allocation_model_recovers_a_log_linear_logit():
    rng = np.random.default_rng()
    k, m, n = _grid(rng)
    a, c = rng.normal(size=3) * 0.5, float(rng.normal())
    x = np.stack([np.log(1.0 + k), np.log(1.0 + m), np.log(n.astype(np.float64))], axis=1)
    p = 1.0 / (1.0 + np.exp(-(x @ a + c)))
    num = 10**9                                       # clipping at 1/(2N) never binds
    model = allocation.AllocationModel.fit(k, m, n, p, num)
    np.testing.assert_allclose(model.a, a, rtol=0, atol=1e-7)
    assert abs(model.c - c) < 1e-7 and not model.b.any()
    np.testing.assert_allclose(allocation.leave_one_out(k, m, n, p, num), p, atol=1e-9)
    # two datasets with different informativeness: b is fitted and recovered too
    b = rng.normal(size=3) * 0.5
    i = np.where(np.arange(len(k))[:, None] % 2 == 0, [0.1, 0.3, 0.0], [0.4, -0.2, 0.0])
    p2 = 1.0 / (1.0 + np.exp(-(x @ a + (i * x) @ b + c)))
    model2 = allocation.AllocationModel.fit(k, m, n, p2, num, informativeness=i)
    np.testing.assert_allclose(model2.predict(k, m, n, i), p2, atol=1e-9)
    np.testing.assert_allclose(model2.b[:2], b[:2], atol=1e-6)   # i's third entry is 0: b[2] is not identifiable


def test_allocation_helpers():
    assert allocation.clipped_logit([0.0, 1.0], 10).tolist() == pytest.approx([np.log(0.05 / 0.95), np.log(0.95 / 0.05)])
    acc = {(0, 0, 1): 0.1, (1, 0, 1): 0.25, (0, 1, 1): 0.05}
    np.testing.assert_allclose(allocation.informativeness(acc), [0.15, -0.05, 0.0])
    with pytest.raises(KeyError, match=r"\(0, 1, 1\)"):
        allocation.informativeness({(0, 0, 1): 0.1, (1, 0, 1): 0.2})
    lengths, scores = [100, 200, 300, 400], [0.2, 0.5, 0.5, 0.9]
    assert allocation.best_under_budget(lengths, scores, 50) is None
    assert allocation.best_under_budget(lengths, scores, 350) == 1          # tie: the shorter one
    assert allocation.best_under_budget(lengths, scores, 500, allowed=[1, 1, 1, 0]) == 1
    assert allocation.slope_per_doubling([2, 4, 8], [0.1, 0.2, 0.3]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="k >= 0"):
        allocation.log_theta([-1], [0], [1])


# -- RAGGED ------------------------------------------------------------------------------------------------------
def _rows(counts, n=40, rng=None):
    """Nested correctness rows: the first c questions of a random permutation are correct (so a smaller count is
    a subset of a larger one)."""
    order = (rng or np.random.default_rng()).permutation(n)
    rows = []
    for c in counts:
        r = np.zeros(n, bool)
        r[order[:c]] = True
        rows.append(r)
    return rows


def test_ragged_scores_hand_computed():
    ks = [0, 1, 2, 4, 8, 16]
    s = ragged_scores(ks, _rows([4, 12, 20, 24, 24, 8]))
    assert s["k_star"] == 4 and s["peak"] == pytest.approx(0.6)
    assert s["stability"] == pytest.approx((0.5 + 0.6 + 0.6) / 3 / 0.6)     # k* = 4 and its neighbours 2, 8
    x, y = np.array([0.0, 1, 2]), np.array([0.3, 0.5, 0.6])                  # log2 k for k = 1, 2, 4
    assert s["scalability"] == pytest.approx(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    assert s["behaviour"] == "peak then decline" and s["decline_p"] < 1e-4   # 16 vs 0 discordant
    plateau = ragged_scores(ks, _rows([4, 12, 20, 24, 24, 23]))
    assert plateau["behaviour"] == "improve then plateau" and plateau["stability"] == pytest.approx((20 + 24 + 24) / 72)
    assert ragged_scores([0, 1, 3], _rows([4, 8, 6]))["stability"] == pytest.approx((8 + 6) / 16)  # k* = 1: no k=0
    assert ragged_scores(ks, _rows([10, 11, 10, 12, 11, 10]))["behaviour"] == "no gain from retrieval"
    with pytest.raises(ValueError, match="strictly increasing"):
        ragged_scores([0, 2, 1], _rows([1, 2, 3]))


# -- runner ------------------------------------------------------------------------------------------------------
class _Recording(Runner):
    """A Runner whose model returns scripted replies and records the prompts it was given."""

    def __init__(self, *args, replies, **kw):
        super().__init__(*args, **kw)
        self.replies, self.seen = list(replies), []

    def generate(self, prompts):
        self.seen.append(list(prompts))
        return [self.replies.pop(0) for _ in prompts]


DOCS = ["# Ann Lee\nThe friend of Ann Lee is Bo Chan.", "# Bo Chan\nThe hobby of Bo Chan is chess.",
        "# Cy Dee\nThe hobby of Cy Dee is golf."]


def _runner(replies, max_seq_len=1024):
    loaded = _tiny(max_seq_len=max_seq_len)
    ranking = {"Who is the friend of Ann Lee?": [0, 2], "What is the hobby of Bo Chan?": [1, 2]}
    search = lambda queries, k: [ranking.get(q, [2, 1, 0])[:k] for q in queries]  # noqa: E731
    demo = drag_demonstration("Who is the friend of Cy Dee?", [DOCS[2]], "Ann Lee")
    return _Recording(loaded, BlockAttention(loaded.model), DOCS, search, drag_demos=[demo],
                      iter_demos=["ITER DEMO\n\n"], mode="full", max_new_tokens=8, batch_size=4, cache=None,
                      fingerprint="t", replies=replies), ChatBlocks(loaded), demo


def test_drag_prompt_and_budget():
    r, chat, demo = _runner(["x", "y"])
    calls = r.drag(["Q one?", "Who is the friend of Ann Lee?"], 2, 1)
    expect = [chat.blocks("Q one?", [DOCS[1], DOCS[2]], demonstrations=[demo]),
              chat.blocks("Who is the friend of Ann Lee?", [DOCS[2], DOCS[0]], demonstrations=[demo])]
    assert r.seen == [expect] and calls.answers == ["x", "y"] and calls.calls == [1, 1]
    assert calls.lengths == [sum(map(len, b)) for b in expect] and calls.truncated == 0


def test_iter_oracle_chains_the_sub_answer_into_the_final_prompt():
    q = "What is the hobby of the friend of Ann Lee?"
    r, chat, demo = _runner(["Bo Chan", "chess"])
    calls = r.iter_oracle([q], 1, 1, 2)
    sub = chat.blocks("Who is the friend of Ann Lee?", [DOCS[0]], demonstrations=[demo])
    chain = "Follow up: Who is the friend of Ann Lee?\nIntermediate answer: Bo Chan\n" + FINAL
    # documents: the question's top 1 (doc 2), the sub-query's (doc 0), the filled final question's (doc 1)
    final = chat.blocks(q, [DOCS[2], DOCS[0], DOCS[1]], demonstrations=["ITER DEMO\n\n"], reply_prefix=chain)
    assert r.seen == [[sub], [final]] and calls.answers == ["chess"] and calls.calls == [2]
    assert calls.lengths == [sum(map(len, sub)) + sum(map(len, final))]


def test_iter_own_follows_the_models_sub_queries():
    r, chat, _ = _runner(["Follow up: What is the hobby of Bo Chan?", "Ann Lee.", "chess", "golf"])
    calls = r.iter_own(["Q1?", "Q2?"], 1, 1, 3)
    # round 1: Q1 asks a sub-query, Q2 answers at once; Q1's intermediate answer; then Q1 answers directly in
    # round 2 ("golf" has no marker: a final answer)
    assert calls.answers == ["golf", "Ann Lee."] and calls.calls == [3, 1]
    second = r.seen[1][0]
    assert bytes(second[-1]).decode().endswith("Follow up: What is the hobby of Bo Chan?\nIntermediate answer: ")
    assert bytes(second[-2]).decode() == f"Document: {DOCS[1]}\n\n"      # the sub-query's document, last


def test_prompt_drops_the_oldest_documents_to_fit_the_window():
    r, chat, _ = _runner([])
    one = sum(map(len, chat.blocks("Q?", [DOCS[2]])))
    r.max_len = one + 5                                                 # room for the best document only
    blocks, cut = r.prompt("Q?", [0, 1, 2], [])
    assert cut and sum(map(len, blocks)) == one
    assert bytes(blocks[-2]).decode() == f"Document: {DOCS[2]}\n\n"     # the last (best) one kept


def test_rag_scaling_end_to_end(tmp_path, monkeypatch):
    base = _tiny(int(np.random.default_rng().integers(1 << 30)))
    monkeypatch.setattr(rag_scaling, "load_model", lambda src: base)   # the name the recipe imported
    argv = ["--generate", "5", "--limit", "2", "--ks", "0,1", "--ms", "0,1", "--iter-ks", "1", "--steps", "2",
            "--ragged-ks", "0,1", "--ragged", "bm25", "--time-ms", "1", "--time-k", "1", "--repeats", "1",
            "--max-new-tokens", "3", "--out", str(tmp_path)]
    assert rag_scaling.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(g["method"], g["k"], g["m"]) for g in report["grid"]] == [
        ("DRAG", 0, 0), ("DRAG", 1, 0), ("DRAG", 0, 1), ("DRAG", 1, 1), ("IterDRAG-oracle", 1, 1),
        ("IterDRAG-own", 1, 1)]
    assert all(len(g["replies"]) == 2 and 0 <= g["correct"] <= 1 for g in report["grid"])
    assert {(r["retriever"], r["mode"]) for r in report["ragged"]} == {("bm25", "full"), ("bm25", "block")}
    assert report["block_saving"][0]["m"] == 1 and Path(report["files"]["scaling"]).is_file()
    assert report["allocation"]["model"]["configs"] == 5
    # a rerun is answered from the reply cache: no generation at all
    monkeypatch.setattr("rag_jax.recipes.rag_scaling.runner.generate_answers",
                        lambda *a, **k: pytest.fail("generated despite the cache"))
    assert rag_scaling.main(argv) == 0
