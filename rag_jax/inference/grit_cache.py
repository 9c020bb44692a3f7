"""GRIT RAG caching: reuse the KV of the embedding pass as the prefix of causal generation.

GritLM (ICLR 2025, §4, App. D; research note ``shared/research/gritlm.md`` §7): the embedder and the
generator are one network, so the keys/values computed while embedding a document (or the query) for
retrieval can be attended by the generator instead of encoding that text again. Modes:

- ``"doc"`` (Doc Caching): cache ``<s><|embed|>\\n{doc}``; generate after it from
  ``\\n<|user|>\\n{query}\\n\\n{ANSWER_PRIOR_QUERY}\\n<|assistant|>\\nThe answer is``.
- ``"query"`` (Query Caching): cache ``<s><|embed|>\\n{query}``; generate from
  ``\\n<|user|>\\n{doc}\\n\\n{ANSWER_WITH_PRIOR_CONTEXT}\\n<|assistant|>\\nThe answer is``.
  (The two instruction sentences are the constants below, from the reference ``rag/eval.py``.)
- ``"query_doc"``: cache ``[query (with <s>), doc (after "\\n<|embed|>\\n", no <s>)]``.
- ``"doc_query"``: cache ``[doc (with <s>), query (with <s>)]``.
- ``"rag_doc_first"`` / ``"rag_query_first"`` (plain RAG): the token ids of the doc (query) caching
  mode, prefilled in one causal pass — the baseline each caching mode is exact against when the
  cached pass is causal (App. D's equivalence condition).

The cached pass is GRIT's bidirectional embedding pass by default (``cache_attention="bidirectional"``,
the paper's "attention mismatch"); ``"causal"`` makes doc caching reproduce ``rag_doc_first`` exactly.
Two-segment caches: each segment is encoded on its own at positions ``0..n-1``; we re-encode the second
to follow the first (``KVSegment.with_positions``, exact because keys are pre-RoPE), whereas the
reference leaves both starting at 0 (notes §7, a positional overlap); ``reencode_positions=False``
reproduces the reference.

Everything is the core machinery: ``encode`` (the embedding pass of ``rag_jax.model.embedding``) gives the
``KVSegment``; ``KVStore`` (``rag_jax.inference.kv_store``) holds it keyed by token ids + model
fingerprint + dtype; ``generate(..., kv_cache=...)`` decodes over it.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from rag_jax.inference.generate import generate
from rag_jax.inference.kv_store import KVStore, WeightsFingerprint
from rag_jax.model.embedding import GritFormat, encode, pad_length, tokenize_for_embedding
from rag_jax.model.kv import KVSegment
from rag_jax.model.transformer import Transformer
from rag_jax.text import Markup, encode_pieces

CACHE_MODES = ("doc", "query", "query_doc", "doc_query")
RAG_MODES = ("rag_doc_first", "rag_query_first")
MODES = RAG_MODES + CACHE_MODES
CACHE_ATTENTION = ("bidirectional", "causal")

ANSWER_PRIOR_QUERY = "Answer the prior query while optionally using the context prior to it"
ANSWER_WITH_PRIOR_CONTEXT = "Optionally using the prior context answer the query prior to it"
ANSWER_START = "The answer is"


class GritCache:
    """GRIT caching modes over one model (batch of one request, as the paper's latency benchmark).

    Args:
      model: a ``Transformer`` or its ``(graphdef, state)``.
      tokenizer: a ``tokenizers.Tokenizer``.
      store: ``KVStore`` for cached texts (default: a 1 GiB device store).
      fmt: prompt strings (BOS/EOS text of the tokenizer).
      cache_attention: ``"bidirectional"`` (GRIT embedding pass) or ``"causal"``.
      reencode_positions: place a second cached segment after the first (True) or at 0 like the reference.
      fingerprint: the model fingerprint for store keys (computed from the weights when None); weights
        changed in place later are noticed and re-hashed (``WeightsFingerprint``), so old entries miss.

    Raises:
      ValueError: an unknown ``cache_attention``.
    """

    def __init__(self, model, tokenizer, *, store: KVStore | None = None, fmt: GritFormat = GritFormat(),
                 cache_attention: str = "bidirectional", reencode_positions: bool = True,
                 fingerprint: str | None = None):
        if cache_attention not in CACHE_ATTENTION:
            raise ValueError(f"cache_attention={cache_attention!r}; valid: {CACHE_ATTENTION}")
        if isinstance(model, Transformer):
            model = nnx.split(model)
        self.graphdef, self.state = model
        self.config = nnx.merge(self.graphdef, self.state).config
        self.tokenizer, self.fmt = tokenizer, fmt
        self.cache_attention, self.reencode_positions = cache_attention, reencode_positions
        self.store = store if store is not None else KVStore(1 << 30)
        self._fingerprint = WeightsFingerprint(self.state, self.config, given=fingerprint)
        graphdef = self.graphdef

        @jax.jit
        def _cache_pass(state, tokens, attention_mask, pool_mask):
            reps, out = encode(nnx.merge(graphdef, state), tokens, attention_mask, pool_mask, mode=cache_attention)
            return reps, out.kv

        self._cache_pass = _cache_pass


    @property
    def fingerprint(self) -> str:
        """The store-key fingerprint of the model's current weights (see ``WeightsFingerprint``)."""
        return self._fingerprint()

    def cached_text_ids(self, text: str, *, bos: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and pool mask of a cached text: ``<s><|embed|>\\n{text}`` or (no BOS) ``\\n<|embed|>\\n{text}``.

        Raises:
          ValueError: empty text, or longer than ``max_seq_len`` tokens.
        """
        prefix = self.fmt.embed_prefix("") if bos else self.fmt.embed
        limit = self.config.max_seq_len
        ids, pool = tokenize_for_embedding(self.tokenizer, text, max_len=limit + 1, fmt=self.fmt, prefix=prefix)
        if len(ids) > limit:
            raise ValueError(f"cached text {text[:60]!r}... is longer than max_seq_len={limit} tokens")
        return ids, pool

    def embed_and_cache(self, text: str, *, bos: bool = True) -> tuple[np.ndarray, KVSegment]:
        """One embedding pass over a cached text: its embedding (float32 ``[hidden]``, unit norm) and its
        KV (``KVSegment`` of ``[num_layers, 1, n, num_kv_heads, head_dim]``, positions ``0..n-1``), which
        is put in the store. Index building calls this once per document (paper §4: cache at index time).
        """
        ids, pool = self.cached_text_ids(text, bos=bos)
        n = len(ids)
        width = min(pad_length(n), self.config.max_seq_len)
        tokens, attn, pm = (np.zeros((1, width), np.int32) for _ in range(3))
        tokens[0, :n], attn[0, :n], pm[0, :n] = ids, 1, pool
        reps, kv = self._cache_pass(self.state, tokens, attn, pm)
        kv = kv.slice(0, n)
        self.store.put(ids, self.fingerprint, kv.k.dtype, kv, namespace=self._namespace(bos))
        return np.asarray(reps[0]), kv

    def kv(self, text: str, *, bos: bool = True) -> KVSegment:
        """The cached KV of ``text`` from the store, computing it on a miss."""
        ids, _ = self.cached_text_ids(text, bos=bos)
        dtype = self.config.compute_dtype
        hit = self.store.get(ids, self.fingerprint, dtype, namespace=self._namespace(bos))
        return hit if hit is not None else self.embed_and_cache(text, bos=bos)[1]

    def _namespace(self, bos: bool) -> str:
        return f"grit|{self.cache_attention}|bos={bos}"

    def _gen_ids(self, content: str, instruction: str) -> list[int]:
        """``\n<|user|>\n{content}\n\n{instruction}\n<|assistant|>\nThe answer is`` (content: a query or doc,
        its special-token text kept as text; ``rag_jax.text``)."""
        pieces = [Markup("\n" + self.fmt.user), content, Markup("\n\n" if content else ""),
                  Markup(instruction + self.fmt.assistant + ANSWER_START)]
        return encode_pieces(self.tokenizer, pieces).ids

    def build(self, mode: str, query: str, doc: str) -> tuple[KVSegment | None, list[int]]:
        """The prefix cache (None for plain RAG) and the prompt ids generated from, for ``mode``.

        Raises:
          ValueError: unknown mode or empty query/doc.
        """
        if mode not in MODES:
            raise ValueError(f"GRIT RAG mode={mode!r}; valid: {MODES}")
        for name, value in (("query", query), ("doc", doc)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name} must be a non-empty string; got {value!r}")
        doc_prompt = self._gen_ids(query, ANSWER_PRIOR_QUERY)
        query_prompt = self._gen_ids(doc, ANSWER_WITH_PRIOR_CONTEXT)
        if mode == "rag_doc_first":
            return None, list(self.cached_text_ids(doc)[0]) + doc_prompt
        if mode == "rag_query_first":
            return None, list(self.cached_text_ids(query)[0]) + query_prompt
        if mode == "doc":
            return self.kv(doc), doc_prompt
        if mode == "query":
            return self.kv(query), query_prompt
        if mode == "query_doc":
            first, second = self.kv(query), self.kv(doc, bos=False)
            prompt = self._gen_ids("", ANSWER_WITH_PRIOR_CONTEXT)
        else:
            first, second = self.kv(doc), self.kv(query)
            prompt = self._gen_ids("", ANSWER_PRIOR_QUERY)
        if self.reencode_positions:
            second = second.with_positions(second.positions + first.length)
        return KVSegment.concat([first, second]), prompt

    def generate(self, mode: str, query: str, doc: str, *, max_new_tokens: int = 16,
                 eos_id: int | None = None) -> np.ndarray:
        """Greedy answer for one (query, doc) in ``mode`` -> int32 ``[max_new_tokens]`` (paper: 16 tokens)."""
        cache, prompt = self.build(mode, query, doc)
        return generate((self.graphdef, self.state), [prompt], max_new_tokens=max_new_tokens, eos_id=eos_id,
                        kv_cache=cache)[0]

