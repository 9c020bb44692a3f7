"""rag_jax.recipes.em_llm.long_context plumbing and EMLLM's attention diagnostics (tiny random model, byte tokens)."""
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.tokenizer import byte_tokenizer
from rag_jax.inference.chat import user_prompt
from rag_jax.recipes.em_llm import long_context, tasks
from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.load import LoadedModel
from test_em_streaming import _rope64  # float64 rotate-half RoPE (tests/ is on sys.path under pytest)

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=512, rope_theta=10000.0)


def _model(seed):
    return Transformer(CFG, rngs=nnx.Rngs(seed))


def test_diagnostic_weights_match_float64_reference():
    """Layer 0 of the decode step: local keys at true distances, init / events / buffer outside the window at
    distance n_local - 1 (note §4.4), one softmax; weights by stream position equal a NumPy float64 softmax."""
    rng = np.random.default_rng(7)
    model = _model(int(rng.integers(1000)))
    tokens = rng.integers(0, 256, 150).astype(np.int32)
    cfg = EMLLMConfig(n_init=4, n_local=32, n_mem=512, chunk_size=16, min_block_size=4, max_block_size=16,
                      index="exact")
    em = EMLLM(model, cfg, diagnose=True)
    em.prefill(tokens)
    positions, weights = em.attention[0]
    seen = positions[(positions >= 0) & (weights.max(0) > 0)]
    assert sorted(seen.tolist()) == list(range(len(tokens)))   # every token exactly once

    x = model.embed(jnp.asarray(tokens)[None])
    q, k, _ = model.layers[0].qkv(x)
    q = np.asarray(q[0, -1], np.float64)                       # [H, d], last token, pre-RoPE
    k = np.asarray(k[0], np.float64)                           # [T, kvh, d]
    inv_freq = np.asarray(model.inv_freq)
    t, group = len(tokens) - 1, CFG.num_heads // CFG.num_kv_heads
    dist = t - np.arange(len(tokens))
    local = dist < cfg.n_local
    k_rot = np.where(local[:, None, None], _rope64(k, -dist, inv_freq), k)   # relative: key at -dist
    q_mem = _rope64(q[None], np.array([cfg.n_local - 1]), inv_freq)[0]
    ref = np.zeros((CFG.num_heads, len(tokens)))
    for h in range(CFG.num_heads):
        logits = np.where(local, k_rot[:, h // group] @ q[h], k[:, h // group] @ q_mem[h]) / np.sqrt(CFG.head_dim)
        ref[h] = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    got = np.zeros_like(ref)
    for j in range(len(tokens)):
        got[:, j] = weights[:, positions == j].sum(1)
    np.testing.assert_allclose(got, ref, atol=2e-5)


def test_long_context_run_and_table(tmp_path: Path):
    rng = np.random.default_rng(3)
    loaded = LoadedModel(config=CFG, model=_model(int(rng.integers(1000))), arch="llama", tokenizer=byte_tokenizer(),
                         chat_template=None, eos_ids=(), special_tokens={}, source=tmp_path)
    sentences = tasks.filler_sentences("repeat")
    ids, key_tokens = tasks.passkey_prompt(loaded, sentences, 400, 0.5, "12345")
    assert abs(len(ids) - 400) <= 30
    assert loaded.tokenizer.decode(ids[key_tokens].tolist()) == "1234512345"
    base = EMLLMConfig(n_init=4, n_local=64, n_mem=64, chunk_size=32, min_block_size=4, max_block_size=16,
                       refine_from_layer=1, index="exact")
    methods = ["em_llm", "em_llm_refine", "em_llm_contiguity", "inf_llm", "sliding", "full"]
    report = long_context.run(loaded, methods, [300, 600], 1, "repeat", base, infllm_block=16, max_new_tokens=3,
                              with_diagnostics=True, log=lambda *_: None)
    rows = report["results"]
    assert [r["method"] for r in rows] == methods + [m for m in methods if m != "full"]
    for r in rows:
        assert isinstance(r["correct"], bool) and r["seconds"] > 0
        assert ("diagnostics" in r) == (r["method"] != "full")
        if "diagnostics" in r:
            layers = r["diagnostics"]["layers"]
            assert len(layers) == CFG.num_layers
            assert all(0 <= x["key_mass_mean"] <= x["key_mass_max_head"] <= 1 + 1e-6 for x in layers)
            assert 0 <= r["diagnostics"]["p_first_token"] <= 1
    table = long_context.summary_table(report)
    for m in methods:
        line = next(x for x in table.splitlines() if x.startswith(f"| {m} "))
        hits = [int(r["correct"]) for r in rows if r["method"] == m]
        assert f"{hits[0]}/1" in line and (m == "full" or f"{hits[1]}/1" in line)
    # Resume: every row is done, nothing runs again; the plot is written.
    again = long_context.run(loaded, methods, [300, 600], 1, "repeat", base, infllm_block=16, max_new_tokens=3,
                             log=lambda *_: None, done=rows, on_row=lambda _: pytest.fail("re-ran a finished row"))
    assert again["results"] == rows
    assert long_context.accuracy(report)["em_llm"] == {300: (int(rows[0]["correct"]), 1),
                                                       600: (int(rows[len(methods)]["correct"]), 1)}
    png = Path(long_context.plot(report, tmp_path / "acc.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _loaded(tmp_path):   # prompts only: no model
    return LoadedModel(config=CFG, model=None, arch="llama", tokenizer=byte_tokenizer(), chat_template=None,
                       eos_ids=(), special_tokens={}, source=tmp_path)


def test_haystack_prompts_place_the_article_and_mark_the_fact(tmp_path):
    loaded = _loaded(tmp_path)
    prompts = tasks.haystack_prompts(loaded, 6000, 3, seed=4)
    assert [p.depth for p in prompts] == [1 / 6, 1 / 2, 5 / 6]
    for p in prompts:
        text = loaded.tokenizer.decode(p.ids.tolist())
        assert abs(len(p.ids) - 6000) < 400 and text.endswith(p.prefix) and p.tag in text
        fact = loaded.tokenizer.decode(p.ids[p.evidence].tolist())
        assert fact == f"{p.prefix} {p.answer}."                              # the one sentence stating it
        assert text.count(fact) == 1
        assert user_prompt(loaded, "".join(p.parts), p.prefix).ids == p.ids.tolist() and fact in p.parts[1]
        assert abs(text.index(fact) / len(text) - p.depth) < 0.15           # ~11 articles: coarse depths
    assert tasks.correct("haystack", " Woodturning, I think.", "woodturning")
    assert not tasks.correct("haystack", " chess", "woodturning")


def test_kv_prompts_mark_the_gold_pair(tmp_path):
    from rag_jax.recipes.em_llm.passkey import KV_FILE
    if not KV_FILE.exists():
        pytest.skip(f"{KV_FILE} absent (shared data)")
    loaded = _loaded(tmp_path)
    (p,) = tasks.kv_prompts(loaded, 1, seed=2)
    text = loaded.tokenizer.decode(p.ids.tolist())
    assert text.endswith(p.prefix) and p.prefix == f'"{p.tag}": "'
    assert loaded.tokenizer.decode(p.ids[p.evidence].tolist()) == f'"{p.tag}": "{p.answer}"'
    assert tasks.correct("kv", f'{p.answer}"}}', p.answer) and not tasks.correct("kv", "x", p.answer)
    assert tasks.correct("passkey", " 12345.", "12345") and not tasks.correct("passkey", " 1234", "12345")


def test_nq_prompts_place_the_gold_passage_among_answerless_ones(tmp_path):
    from rag_jax.metrics import normalize_answer
    if not tasks.NQ_FILE.exists():
        pytest.skip(f"{tasks.NQ_FILE} absent (shared data)")
    loaded = _loaded(tmp_path)
    seed = int(np.random.default_rng().integers(1000))
    prompts = tasks.nq_prompts(loaded, 8000, 3, seed=seed)
    assert [p.depth for p in prompts] == [1 / 6, 1 / 2, 5 / 6] and len({p.tag for p in prompts}) == 3
    for p in prompts:
        text = loaded.tokenizer.decode(p.ids.tolist())
        assert abs(len(p.ids) - 8000) < 800 and p.parts[2] in text[-200:]
        assert p.parts[2].endswith(p.tag + "\nAnswer briefly.")
        gold = loaded.tokenizer.decode(p.ids[p.evidence].tolist())
        assert gold.startswith("Document (Title: ") and text.count(gold) == 1
        docs = p.parts[1].split("\n\nDocument ")
        assert len(docs) > 5 and user_prompt(loaded, "".join(p.parts), "").ids == p.ids.tolist()
        at = [i for i, d in enumerate(docs) if ("Document " if i else "") + d.strip() == gold.strip()]
        assert at == [round(p.depth * (len(docs) - 1))]          # the depth counts passages
        golds = [normalize_answer(a) for a in p.answers]
        holding = [d for d in docs if any(g in normalize_answer(d) for g in golds)]
        assert len(holding) == 1 and gold.strip().endswith(holding[0].strip())   # only the gold passage answers
        assert tasks.score("nq", f"I think {p.answers[-1]}.", p) == 1.0 and tasks.score("nq", "no idea", p) == 0.0
    again = tasks.nq_prompts(loaded, 8000, 3, seed=seed)
    assert all(np.array_equal(a.ids, b.ids) for a, b in zip(prompts, again))


def test_full_attention_reply_may_run_past_the_trained_context(tmp_path):
    """A prompt filling max_seq_len still gets its reply (positions past it), the same as a longer context's."""
    short = CFG.replace(max_seq_len=64)
    model = Transformer(short, rngs=nnx.Rngs(5))
    ids = np.random.default_rng(5).integers(0, 256, 62).astype(np.int32)
    loaded = LoadedModel(config=short, model=model, arch="llama", tokenizer=byte_tokenizer(), chat_template=None,
                         eos_ids=(), special_tokens={}, source=tmp_path)
    got = long_context.full_generate(loaded, ids, 6)
    assert model.config.max_seq_len == 64                                # the caller's model is unchanged
    longer = Transformer(CFG, rngs=nnx.Rngs(5))                          # same weights, max_seq_len 512
    assert got == long_context.full_generate(dataclasses.replace(loaded, model=longer), ids, 6) and len(got) == 6


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "<|im_start|>assistant\n")


def test_rag_methods_read_the_top_chunks_whole_or_as_blocks(tmp_path):
    """LaRA's RAG side: the short prompt's blocks concatenate to the chat prompt of ``rag_content`` (chosen chunks
    in the haystack's place, same reply prefix), each rag_* row's reply is that prompt's greedy reply under its
    attention mode, and a task without a haystack is refused before any compute."""
    from rag_jax.evaluation.chunk_rag import chunks, rag_blocks, rag_content, top_chunks
    from rag_jax.evaluation.rag import generate_answers
    from rag_jax.inference.block_attention import BlockAttention

    loaded = LoadedModel(config=CFG, model=_model(int(np.random.default_rng().integers(1 << 30))), arch="llama",
                         tokenizer=byte_tokenizer(), chat_template=CHAT, eos_ids=(10,),
                         special_tokens={"eos_token": "\n"}, source=tmp_path)
    base = EMLLMConfig(n_init=4, n_local=64, n_mem=64, chunk_size=32, min_block_size=4, max_block_size=16)
    report = long_context.run(loaded, ["rag_bm25", "rag_bm25_block"], [480], 2, "repeat", base, max_new_tokens=4,
                              log=lambda *_: None, task="niah_single", rag_top_k=3)
    prompts = tasks.make_prompts(loaded, "niah_single", 480, 2, 0, "repeat")
    for prompt in prompts:
        blocks = rag_blocks(loaded, prompt.parts, prompt.parts[2], 3, prompt.prefix)
        content = rag_content(prompt.parts, prompt.parts[2], 3)
        assert [t for b in blocks for t in b] == user_prompt(loaded, content, prompt.prefix).ids
        assert len(blocks) == 2 + min(3, len(chunks(prompt.parts[1])))
        kept = top_chunks(chunks(prompt.parts[1]), prompt.parts[2], 3)
        assert kept == sorted(kept)
        for mode, method in (("full", "rag_bm25"), ("block", "rag_bm25_block")):
            row = next(r for r in report["results"] if r["method"] == method and r["key"] == prompt.tag)
            want = generate_answers(BlockAttention(loaded.model), loaded.tokenizer, [blocks], mode=mode,
                                    max_new_tokens=4, batch_size=1, eos_id=(10,))[0]
            assert row["reply"] == want and row["tokens"] == len(prompt.ids)
    with pytest.raises(ValueError, match="needs a task with a haystack"):
        long_context.run(loaded, ["rag_minilm"], [400], 1, "repeat", base, task="passkey")
