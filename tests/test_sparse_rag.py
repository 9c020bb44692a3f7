"""Sparse RAG (rag_jax/recipes/sparse_rag): control tokens added without changing any other logit, their rows the
mean of the init words' rows (NumPy), passages that spell a control token stay text, P(relevant) against the
training-path forward (block mask from the example's arrays), cache selection, and the eval end to end on a tiny
chat model (one fine-tuning step; the run folder loads back with the control tokens)."""
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.inference.block_attention import BlockAttention
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.load import LoadedModel
from rag_jax.recipes.sparse_rag import engine, sparse_rag
from rag_jax.text import encode_content
from rag_jax.tokenizer import byte_tokenizer

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  max_seq_len=4096, dtype="float32")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "<|im_start|>assistant\n")


def _tiny(seed, tie=True):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    return LoadedModel(cfg, Transformer(cfg, rngs=nnx.Rngs(seed)), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                       (10,), {"eos_token": "\n"}, Path("tiny-chat"))


@pytest.mark.parametrize("tie", [True, False])
def test_control_tokens_extend_the_vocabulary_and_leave_other_logits(tie):
    rng = np.random.default_rng()
    base = _tiny(int(rng.integers(1 << 30)), tie)
    new = engine.add_control_tokens(base)
    ids = engine.control_ids(new.tokenizer)
    assert ids == (256, 257, 258) and new.config.vocab_size == 259 and base.config.vocab_size == 256
    emb = np.asarray(base.model.embedding[...], np.float64)
    for i, word in zip(ids, engine.INIT_WORDS):
        want = emb[list(word.encode())].mean(axis=0)                     # byte tokens: the word's UTF-8 bytes
        np.testing.assert_allclose(np.asarray(new.model.embedding[...])[i], want, atol=1e-6)
        if not tie:
            np.testing.assert_allclose(np.asarray(new.model.lm_head[...])[:, i],
                                       np.asarray(base.model.lm_head[...], np.float64)[:, list(word.encode())].mean(1),
                                       atol=1e-6)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 17)), jnp.int32)
    pos, seg = jnp.broadcast_to(jnp.arange(17), (2, 17)), jnp.ones((2, 17), jnp.int32)
    old, grown = base.model(tokens, pos, seg).logits, new.model(tokens, pos, seg).logits
    assert grown.shape[-1] == 259
    np.testing.assert_allclose(grown[..., :256], old, atol=1e-5)
    # untrusted text that spells a control token stays bytes; the tokenizer's own markup parses it
    assert 257 not in encode_content(new.tokenizer, "a <|relevant|> b")
    assert new.tokenizer.encode("x<|relevant|>").ids == [120, 257]
    with pytest.raises(ValueError, match="already has"):
        engine.add_control_tokens(new)
    with pytest.raises(ValueError, match="no Sparse RAG control token"):
        engine.SparseRAG(base, BlockAttention(base.model))


def test_assessment_probability_is_the_training_forward_at_the_assess_token():
    loaded = engine.add_control_tokens(_tiny(int(np.random.default_rng().integers(1 << 30))))
    rag = engine.SparseRAG(loaded, BlockAttention(loaded.model))
    passages = ["# Ann Lee\nThe hobby of Ann Lee is chess.", "# Bo\nThe job of Bo is baker. <|relevant|>"]
    p = rag.assess("What is the hobby of Ann Lee?", passages)
    for prob, passage in zip(p, passages):
        ex = rag.assessment_example("What is the hobby of Ann Lee?", passage, True)
        assert ex.blocks[-1][-1] == rag.assess_id and ex.response == (rag.relevant_id, 10)
        a = {k: jnp.asarray(v)[None] for k, v in ex.to_arrays().items()}
        logits = np.asarray(loaded.model(a["tokens"], a["positions"], a["segment_ids"], mode="block",
                                         is_global=a["is_global"]).logits, np.float64)[0]
        z = logits[sum(map(len, ex.blocks)) - 1]
        want = np.exp(z[rag.relevant_id]) / (np.exp(z[rag.relevant_id]) + np.exp(z[rag.irrelevant_id]))
        assert prob == pytest.approx(want, abs=1e-5)
    ans = rag.answer_example("Q?", passages, "chess")
    assert len(ans.blocks) == 4 and bytes(ans.response[:-1]).decode() == "chess"


def test_keep_selects_in_prompt_order():
    p = [0.2, 0.9, 0.5, 0.9, 0.1]
    assert engine.keep(p, top_m=2) == [1, 3] and engine.keep(p, top_m=3) == [1, 2, 3]
    assert engine.keep(p, threshold=0.5) == [1, 2, 3] and engine.keep(p, threshold=0.95) == []
    with pytest.raises(ValueError, match="exactly one"):
        engine.keep(p)
    conds = sparse_rag.conditions(np.array([0.1, 0.8, 0.3]), [7, 5, 9], [5], [1, 2])
    # prompt order is best last: [9, 5, 7]; the model's top 1 is prompt index 1 -> passage 5
    assert conds["dense"] == [9, 5, 7] and conds["sparse top-1"] == [5] and conds["sparse top-2"] == [5, 7]
    assert conds["retriever top-2"] == [5, 7] and conds["oracle"] == [5] and conds["sparse p>=0.5"] == [5]


def test_sparse_rag_eval_end_to_end(tmp_path, monkeypatch):
    base = _tiny(int(np.random.default_rng().integers(1 << 30)))
    from rag_jax.model import load as load_lib
    monkeypatch.setattr(sparse_rag, "load_model",
                        lambda src: base if src == "smollm2-135m-instruct" else load_lib.load_model(src))
    argv = ["--generate", "2", "--num-passages", "3", "--train-questions", "4", "--eval-questions", "3",
            "--steps", "1", "--batch-size", "8", "--top-layers", "1", "--keep", "1,2", "--max-new-tokens", "3",
            "--time-prompts", "1", "--out", str(tmp_path)]
    assert sparse_rag.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["results"]) == {"dense", "sparse top-1", "sparse top-2", "retriever top-1", "retriever top-2",
                                      "sparse p>=0.5", "oracle"}
    for name, r in report["results"].items():
        assert len(r["replies"]) == 3 and 0 <= r["accuracy"] <= 1 and np.isfinite(r["decode_ms"])
    assert report["results"]["dense"]["caches"] == 3 and report["results"]["sparse top-1"]["caches"] == 1
    assert report["results"]["oracle"]["gold_kept"] == 1.0
    tuned = load_lib.load_model(str(tmp_path / "run"))
    assert tuned.config.vocab_size == 259 and engine.control_ids(tuned.tokenizer) == (256, 257, 258)


def test_nq_task_split_gold_ids_and_scoring(tmp_path):
    """``--nq``: every question's gold id is its oracle passage in the pool (shared passages deduplicated), the
    split is block_nq's (``heldout_split``), NQ replies are scored by best-subspan EM (any answer) and PhantomWiki
    replies by containing every answer; the training answer is NQ's first answer."""
    import gzip
    import json

    from rag_jax.data.loaders import heldout_split
    from rag_jax.recipes.sparse_rag import sparse_rag as sr
    rng = np.random.default_rng()
    n = int(rng.integers(12, 30))
    titles = [f"T{int(t)}" for t in rng.integers(0, 6, n)]            # repeated titles: shared gold passages
    lines = [{"question": f"q{i}?", "answers": [f"ans{i}", f"alt{i}"],
              "ctxs": [{"title": t, "text": f"text of {t}", "hasanswer": True, "isgold": True}]}
             for i, t in enumerate(titles)]
    path = tmp_path / "nq.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    seed = int(rng.integers(100))
    train, held, docs = sr.nq_task(path, 0.25, seed)
    tr_idx, ho_idx = heldout_split(n, 0.25, seed)
    assert [q["question"] for q in train] == [f"q{i}?" for i in tr_idx]
    assert [q["question"] for q in held] == [f"q{i}?" for i in ho_idx]
    assert len(docs) == len(set(titles))
    for q in train + held:
        i = int(q["question"][1:-1])
        assert docs[q["gold"][0]] == f"(Title: {titles[i]}) text of {titles[i]}"
    q = held[0]
    assert sr.is_correct(f"It is {q['answers'][1]}.", q) and not sr.is_correct("no idea", q)
    assert sr.target_answer(q) == q["answers"][0]
    phantom = {"question": "x", "answer": ["Ann", "Bob"]}
    assert sr.is_correct("Ann and Bob", phantom) and not sr.is_correct("Ann", phantom)
