"""Block-Attention data: per-block tokenization, array layout, SFT splitter; block mask vs the paper's definition."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from rag_jax.data import block_rag
from rag_jax.data.block_rag import (BlockExample, build_rag_example, build_sft_example, collate, merge_smallest,
                                    split_blocks, split_by_delimiter)
from rag_jax.model.masks import build_mask

CORPUS = [
    "- Title: Abraham Kindred\nThe sister of Abraham Kindred is Dani Brumfield.\n\n",
    "Please write a high-quality answer for the given question using only the provided search documents.",
    "<|user|>\nYou are an intelligent AI assistant. Question: Who is the friend of Abraham?\n<|assistant|>\n",
    "The hobby of Dani Brumfield is microscopy.\n\nThe father of Ahmad Kindred is Stefan Kindred.\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


PASSAGES = [{"title": "Abraham Kindred", "text": "The sister of Abraham Kindred is Dani Brumfield."},
            {"title": "Dani Brumfield", "text": "The hobby of Dani Brumfield is microscopy."},
            {"title": "Ahmad Kindred", "text": "The father of Ahmad Kindred is Stefan Kindred."}]


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def test_rag_example_tokenizes_each_block_separately(tokenizer):
    ex = build_rag_example(tokenizer, "Who is the sister of Abraham Kindred?", PASSAGES, "Dani Brumfield")
    texts = [block_rag.RAG_SYSTEM] + [block_rag.RAG_PASSAGE.format(**p) for p in PASSAGES] + \
        [block_rag.RAG_LAST.format(question="Who is the sister of Abraham Kindred?")]
    assert len(ex.blocks) == 5
    assert [list(b) for b in ex.blocks] == [_ids(tokenizer, t) for t in texts]
    assert list(ex.response) == _ids(tokenizer, "Dani Brumfield<|end_of_text|>")
    # Block boundaries change the ids vs tokenizing the joined prompt (byte-level BPE merges across "\n\n").
    assert ex.prompt != _ids(tokenizer, "".join(texts))
    grouped = build_rag_example(tokenizer, "q?", PASSAGES, passages_per_block=2)
    assert len(grouped.blocks) == 4 and grouped.response == ()
    assert list(grouped.blocks[1]) == _ids(tokenizer, "".join(block_rag.RAG_PASSAGE.format(**p) for p in PASSAGES[:2]))


def test_arrays_layout_and_collate(tokenizer):
    ex = BlockExample(blocks=((5, 6, 7), (8, 9), (10, 11)), response=(12, 13, 14))
    a = ex.to_arrays(12)
    np.testing.assert_array_equal(a["tokens"], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0])
    np.testing.assert_array_equal(a["segment_ids"], [1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 0, 0])
    np.testing.assert_array_equal(a["is_global"], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(a["loss_mask"], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(a["positions"], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0])
    batch = collate([ex, BlockExample(((1, 2),), (3,))], 12)
    assert batch["tokens"].shape == (2, 12) and batch["tokens"].dtype == np.int32
    np.testing.assert_array_equal(batch["segment_ids"][1], [1, 1, 1] + [0] * 9)
    with pytest.raises(ValueError, match="seq_len=5"):
        ex.to_arrays(5)
    with pytest.raises(ValueError, match="blocks\\[1\\] is empty"):
        BlockExample(((1,), ()), ())
    with pytest.raises(ValueError, match="at least one block"):
        BlockExample((), ())
    with pytest.raises(ValueError, match="max_len=10"):
        build_rag_example(tokenizer, "q?", PASSAGES, "answer", max_len=10)


def test_split_by_delimiter_priority():
    assert split_by_delimiter("a\nb\n\nc---d\n\ne") == ["a\nb\n\n", "c---d\n\n", "e"]    # "\n\n" wins
    assert split_by_delimiter("a\n---\nb === c") == ["a\n---\n", "b === c"]             # then ---
    assert split_by_delimiter("a === b\nc") == ["a === ", "b\nc"]                        # then ===
    assert split_by_delimiter("x\n\ty\n\tz\nw") == ["x\n\t", "y\n\t", "z\nw"]             # then \n\t
    assert split_by_delimiter("l1\nl2  \n l3") == ["l1\n", "l2  \n ", "l3"]               # finally \n
    assert split_by_delimiter("\n\nlead and trail\n\n") == ["\n\nlead and trail\n\n"]
    assert split_by_delimiter("no delimiter") == ["no delimiter"]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab \n\t-=", max_size=80), st.integers(1, 6))
def test_split_blocks_is_lossless_and_bounded(text, max_blocks):
    blocks = split_blocks(text, max_blocks=max_blocks)
    assert "".join(blocks) == text
    assert len(blocks) <= max_blocks


def test_merge_smallest_merges_the_smallest_adjacent_pair():
    assert merge_smallest(["aaaa", "b", "c", "dddd", "e"], 4) == ["aaaa", "bc", "dddd", "e"]
    assert merge_smallest(["aaaa", "b", "c", "dddd", "e"], 3) == ["aaaa", "bc", "dddde"]
    assert merge_smallest(["x", "y"], 1) == ["xy"]


def test_sft_example_blocks(tokenizer):
    single = [{"role": "user", "content": "Part one.\n\nPart two.\n\nQuestion?"},
              {"role": "assistant", "content": "Answer."}]
    ex = build_sft_example(tokenizer, single)
    texts = ["<|user|>\nPart one.\n\n", "Part two.\n\n", "Question?\n<|assistant|>\n"]
    assert [list(b) for b in ex.blocks] == [_ids(tokenizer, t) for t in texts]
    assert list(ex.response) == _ids(tokenizer, "Answer.<|end_of_text|>")
    multi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n\nthere"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "A\n\nB"},
             {"role": "assistant", "content": "C"}]
    ex = build_sft_example(tokenizer, multi, max_blocks=3)
    # chunks merge within their message only: the user's two chunks merge, then every message is one
    # block, so 4 blocks remain (more than max_blocks, as in the reference)
    texts = ["<|system|>\nBe brief.\n", "<|user|>\nHi\n\nthere\n", "<|assistant|>\nHello<|end_of_text|>\n",
             "<|user|>\nA\n\nB\n<|assistant|>\n"]          # last user message = one global block
    assert [list(b) for b in ex.blocks] == [_ids(tokenizer, t) for t in texts]
    with pytest.raises(ValueError, match="last message must be the assistant"):
        build_sft_example(tokenizer, multi[:-1])
    with pytest.raises(ValueError, match="role"):
        build_sft_example(tokenizer, [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}])


def _chars(text):
    return [ord(c) for c in text]


def _block_texts(ex):
    return ["".join(map(chr, b)) for b in ex.blocks]


def test_sft_blocks_never_span_two_messages():
    """Issue 17 item 6: the greedy cross-message merge put "B\\n" and "<|assistant|>\\nC" in one block."""
    chat = [{"role": "user", "content": "Aaaa\n\nB"}, {"role": "assistant", "content": "C\n\nDddd"},
            {"role": "user", "content": "E"}, {"role": "assistant", "content": "R"}]
    ex = build_sft_example(_chars, chat, max_blocks=3)
    assert _block_texts(ex) == ["<|user|>\nAaaa\n\nB\n", "<|assistant|>\nC\n\nDddd<|end_of_text|>\n",
                                "<|user|>\nE\n<|assistant|>\n"]


ROLES = st.sampled_from(["system", "user", "assistant"])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(ROLES, st.text(alphabet="ab\n-", min_size=1, max_size=30)), min_size=1, max_size=6),
       st.integers(1, 8))
def test_sft_blocks_partition_messages(prompt, max_blocks):
    """Independent check: the blocks tile the role-wrapped prompt, no block crosses a message boundary,
    and the block count is the target unless the per-message floor (or the chunk count) forbids it."""
    chat = [{"role": r, "content": c} for r, c in prompt] + [{"role": "assistant", "content": "ok"}]
    ex = build_sft_example(_chars, chat, max_blocks=max_blocks)
    wrapped = [block_rag.ROLE_WRAPPERS[r][0] + c + block_rag.ROLE_WRAPPERS[r][1] for r, c in prompt]
    texts = _block_texts(ex)
    assert "".join(texts) == "".join(wrapped) + block_rag.ASSISTANT_TAG
    ends = np.cumsum([len(w) for w in wrapped])
    start = 0
    for i, t in enumerate(texts):
        end = start + len(t) - (len(block_rag.ASSISTANT_TAG) if i == len(texts) - 1 else 0)
        message = int(np.searchsorted(ends, start, side="right"))
        assert end <= ends[message], f"block {i} {t!r} crosses into message {message + 1}"
        start = end
    n_chunks = sum(len(split_by_delimiter(c)) for _, c in prompt[:-1]) + (1 if len(prompt) > 1 else
                                                                         len(split_by_delimiter(prompt[0][1])))
    assert len(texts) == min(n_chunks, max(max_blocks, len(prompt)))


def _paper_block_mask(local_sizes: list[int], global_size: int, pad: int) -> np.ndarray:
    """The reference mask (note §1.2, ``src/data/block.py::build_attention_mask``) + padding rows/cols."""
    n = sum(local_sizes) + global_size
    m = np.zeros((n + pad, n + pad), bool)
    off = 0
    for size in local_sizes:
        m[off:off + size, off:off + size] = np.tril(np.ones((size, size), bool))
        off += size
    m[n - global_size:n, :n] = np.tril(np.ones((n, n), bool))[n - global_size:]
    return m


def test_paper_docstring_example():
    assert _paper_block_mask([1, 2], 1, 0).astype(int).tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0],
                                                                    [1, 1, 1, 1]]


@pytest.mark.parametrize("seed", range(6))
def test_block_mask_matches_paper_definition(seed):
    rng = np.random.default_rng(seed)
    num_local = int(rng.integers(0, 6))
    local = rng.integers(1, 7, num_local).tolist()
    last, response, pad = int(rng.integers(1, 5)), int(rng.integers(0, 4)), int(rng.integers(0, 3))
    blocks = tuple(tuple(rng.integers(1, 100, n).tolist()) for n in local + [last])
    arrays = BlockExample(blocks, tuple(rng.integers(1, 100, response).tolist())).to_arrays(
        sum(local) + last + response + pad)
    mask = build_mask("block", jnp.asarray(arrays["segment_ids"])[None], jnp.asarray(arrays["segment_ids"])[None],
                      q_is_global=jnp.asarray(arrays["is_global"])[None])
    np.testing.assert_array_equal(np.asarray(mask[0]), _paper_block_mask(local, last + response, pad))


@pytest.mark.parametrize("seed", range(3))
def test_mixed_batch_has_each_example_once_per_mode(seed):
    """``mixed_batch``: B full rows then the same B examples as block rows; the full rows' block-mode mask is
    plain causal attention over the real tokens, the block rows' mask is the paper's (NumPy references)."""
    rng = np.random.default_rng([seed, 17])
    shapes = [(rng.integers(1, 7, int(rng.integers(0, 5))).tolist(), int(rng.integers(1, 5)), int(rng.integers(1, 4)))
              for _ in range(int(rng.integers(1, 5)))]
    examples = [BlockExample(tuple(tuple(rng.integers(1, 100, n).tolist()) for n in local + [last]),
                             tuple(rng.integers(1, 100, resp).tolist())) for local, last, resp in shapes]
    seq = max(ex.num_tokens for ex in examples) + int(rng.integers(0, 3))
    batch, b = block_rag.mixed_batch(examples, seq), len(examples)
    assert {k: v.shape for k, v in batch.items()} == {k: (2 * b, seq) for k in batch}
    ref = collate(examples, seq)
    for k in ref:
        np.testing.assert_array_equal(batch[k][b:], ref[k])
        if k != "is_global":
            np.testing.assert_array_equal(batch[k][:b], ref[k])
    np.testing.assert_array_equal(batch["is_global"][:b], ref["segment_ids"] > 0)
    mask = np.asarray(build_mask("block", jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["segment_ids"]),
                                 q_is_global=jnp.asarray(batch["is_global"])))
    for i, (ex, (local, last, resp)) in enumerate(zip(examples, shapes)):
        n = ex.num_tokens
        causal = np.zeros((seq, seq), bool)
        causal[:n, :n] = np.tril(np.ones((n, n), bool))
        np.testing.assert_array_equal(mask[i], causal)
        np.testing.assert_array_equal(mask[b + i], _paper_block_mask(local, last + resp, seq - n))
    with pytest.raises(ValueError, match="at least one example"):
        block_rag.mixed_batch([], seq)
