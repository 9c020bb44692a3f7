"""Block-Attention inference: passage KV reuse with RoPE position re-encoding.

Block-Attention (Ma, Wang, Lan, ICLR 2025, §2.3; research note ``shared/research/block_attention.md``
§1.3 and §1.7). A prompt is a list of blocks ``[b_1, ..., b_{n-1}, last]``:

1. every block but the last is encoded **alone** at local positions 0..n_b-1 (a causal forward over
   the block only) and its pre-RoPE keys and values are cached in a ``KVStore`` keyed by the block's
   token ids, the model fingerprint and the KV dtype;
2. each cached block is re-encoded to its offset ``o_b = sum of earlier block lengths``:
   ``k = R(o_b)·k̃`` is just ``seg.with_positions(seg.positions + o_b)`` because keys are stored
   pre-RoPE and rotated at attention time. This is exact: under the block mask a local block's
   hidden states do not depend on its offset (note §1.3), and there is no bf16 un-rotate/re-rotate
   round trip as in the reference server (note §1.8, defect 8);
3. only the last block is prefilled, at positions ``o_n..o_n+n_last-1``, attending to all cached
   blocks and causally to itself; decoding continues from there (core ``generate(kv_cache=...)``).

With ``prefix="sink"`` or ``"system"`` (``rag_jax.inference.block_prefix``, APE's shared prefix) step 1
encodes every block after the first causally after the first token / all of the first block (its KV, at local
positions ``P..``) instead of alone; the store keys such entries by the prefix too.

``mode="full"`` runs the same prompt (blocks concatenated, no marker) with plain causal attention,
for comparison. With ``marker_ids`` (the ``[Block-Attention]`` ids used in block fine-tuning,
``rag_jax.train.objectives.block``) block mode prepends them to the first block, matching training
(the reference server computes them but never prepends them, note §1.8 defect 2).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import hashlib

import numpy as np
from flax import nnx

from rag_jax.inference.block_prefix import bucket_length, prefix_length
from rag_jax.inference.generate import generate as core_generate
from rag_jax.inference.kv_store import KVStore, WeightsFingerprint
from rag_jax.model import KVSegment, Transformer
from rag_jax.model.xla_options import forward_options, jit_by_options

MODES = ("block", "full")
STORE_NAMESPACE = "block"  # store entries of passage blocks encoded alone, causal, at positions 0..n-1


class Prefill(NamedTuple):
    """Result of ``BlockAttention.prefill`` (batch 1).

    logits: float32 ``[last_len, vocab]``, the logits of the last block's tokens.
    cache: the re-encoded cached blocks (block mode; may end with empty slots), or None.
    kv: pre-RoPE KV of the tokens prefilled here (the last block, or the whole prompt in full mode;
      may end with empty padding slots). ``KVSegment.concat([cache, kv])`` continues decoding.
    """

    logits: jax.Array
    cache: KVSegment | None
    kv: KVSegment


def _forward_program(graphdef, state, tokens, positions, segment_ids, kv_cache, keep_from, keep):
    """Causal forward of ``tokens [1, n]`` after ``kv_cache`` (or alone).

    Returns (float32 logits ``[keep, vocab]`` of tokens ``keep_from..keep_from+keep-1``, new-token KV).
    Logits are computed from the kept hidden rows only, so a full prefill does not pay for
    ``n x vocab`` logits it does not need (the model's own all-row logits are dead code here).
    """
    model = nnx.merge(graphdef, state)
    out = model(tokens, positions, segment_ids, mode="causal", kv_cache=kv_cache)
    hidden = jax.lax.dynamic_slice_in_dim(out.hidden, keep_from, keep, axis=1)
    return model.logits(hidden)[0], out.kv


_forward_jit = jit_by_options(_forward_program, static_argnames=("graphdef", "keep"))  # by xla_options.forward_options


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_forward(graphdef, state, tokens: np.ndarray, start: int, kv_cache, multiple: int, keep: int,
                    width: int | None = None):
    """``_forward_program`` of one row at positions ``start..``, right-padded to ``width`` tokens (default: the next
    multiple of ``multiple``).

    Padding (``segment_ids`` 0) comes after the real tokens, so it changes nothing they see; it only
    bounds the number of compiled shapes. Returns (logits ``[keep, vocab]`` of the last ``keep`` real
    tokens, KV of the padded row: the n real tokens then empty slots).
    """
    n = tokens.size
    width = _round_up(n, multiple) if width is None else width
    padded = np.zeros((1, width), np.int32)
    padded[0, :n] = tokens
    segment_ids = (np.arange(width) < n).astype(np.int32)[None]
    positions = np.where(segment_ids > 0, start + np.arange(width), 0).astype(np.int32)
    kept = min(_round_up(keep, multiple), width)      # padded too, so `keep` does not recompile
    keep_from = min(n - keep, width - kept)
    logits, kv = _forward_jit(forward_options(width))(graphdef, state, jnp.asarray(padded), jnp.asarray(positions),
                                                      jnp.asarray(segment_ids), kv_cache, jnp.int32(keep_from), kept)
    return logits[n - keep - keep_from:n - keep_from], kv


class BlockAttention:
    """Prompt assembly from cached passage blocks (see module docstring).

    Args:
      model: a ``Transformer`` or its ``(graphdef, state)``.
      store: the passage KV store (default: a new 1 GiB store).
      max_block_len: longest allowed block in tokens (default ``max_seq_len``).
      max_blocks: most blocks per prompt, the last block included (default: no limit).
      marker_ids: ids prepended to the first block in block mode (see module docstring).
      fingerprint: model identity for the store keys; default ``model_fingerprint`` of the weights
        and config (reads every parameter once; pass e.g. a checkpoint id to skip that). Either way,
        weights changed in place later (``nnx.update``) are noticed and re-hashed
        (``WeightsFingerprint``): cached blocks of the old weights then miss.
      pad_multiple: blocks, the last block and assembled caches are padded (with never-attended
        slots) to a multiple of this many tokens, so varying lengths reuse compiled shapes.
      prefix: ``"none"`` (every block encoded alone), ``"sink"`` or ``"system"``: blocks after the first are
        encoded after the first block's first token / all of it; ``"nosink"``: encoded alone, each one's first
        token (the sink it grows) hidden from the tokens after it (``block_prefix.PREFIXES``).
      passage_temperature: ``T``; in block mode the keys of the blocks after the first are divided by ``T`` when
        assembled, so every later token's attention logits to passage tokens are divided by ``T`` (APE, Yang et
        al., ICLR 2025, §3.2: a temperature below 1 sharpens attention over parallel-encoded contexts); 1 = off.
        Stored blocks are unscaled.

    Raises:
      ValueError: ``pad_multiple < 1``, an unknown ``prefix`` or ``passage_temperature <= 0``.
    """

    def __init__(self, model: Transformer | tuple, *, store: KVStore | None = None, max_block_len: int | None = None,
                 max_blocks: int | None = None, marker_ids: Sequence[int] = (), fingerprint: str | None = None,
                 pad_multiple: int = 16, prefix: str = "none", passage_temperature: float = 1.0):
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple={pad_multiple} must be >= 1 tokens")
        if not passage_temperature > 0:
            raise ValueError(f"passage_temperature={passage_temperature} must be > 0 (1 = off)")
        self.passage_temperature = float(passage_temperature)
        prefix_length(prefix, 1)  # validates the name
        self.prefix = prefix
        self.pad_multiple = int(pad_multiple)
        self.graphdef, self.state = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.config = nnx.merge(self.graphdef, self.state).config
        self.store = store if store is not None else KVStore(max_bytes=1 << 30)
        self.max_block_len = self.config.max_seq_len if max_block_len is None else int(max_block_len)
        self.max_blocks = max_blocks
        self.marker_ids = tuple(int(i) for i in marker_ids)
        self.dtype = self.config.compute_dtype
        self._fingerprint = WeightsFingerprint(self.state, self.config.fingerprint(), given=fingerprint)

    @property
    def fingerprint(self) -> str:
        """The store-key fingerprint of the model's current weights (see ``WeightsFingerprint``)."""
        return self._fingerprint()

    def check_blocks(self, blocks: Sequence[Sequence[int]], mode: str = "block", extra_tokens: int = 0
                     ) -> list[np.ndarray]:
        """Validate a prompt's blocks before any compute; returns them as int32 arrays (marker applied).

        Raises:
          ValueError: unknown mode, zero blocks, an empty block, a block longer than
            ``max_block_len``, more than ``max_blocks`` blocks, a token id outside the vocabulary, or
            total tokens (+ ``extra_tokens``, e.g. new tokens to generate) beyond ``max_seq_len``.
        """
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; valid: {MODES}")
        if len(blocks) == 0:
            raise ValueError("blocks is empty; a prompt needs at least one block (the last block)")
        if self.max_blocks is not None and len(blocks) > self.max_blocks:
            raise ValueError(f"{len(blocks)} blocks exceed max_blocks={self.max_blocks}; merge passages into "
                             "fewer blocks or raise the limit")
        arrays = [np.asarray(b, np.int32).reshape(-1) for b in blocks]
        vocab = self.config.vocab_size
        for i, b in enumerate(arrays):
            if b.size == 0:
                raise ValueError(f"block {i} is empty; every block needs at least one token")
            if b.size > self.max_block_len:
                raise ValueError(f"block {i} has {b.size} tokens > max_block_len={self.max_block_len}")
            if b.min() < 0 or b.max() >= vocab:
                raise ValueError(f"block {i} has token id {b.max() if b.max() >= vocab else b.min()} outside "
                                 f"[0, vocab_size={vocab})")
        if mode == "block" and self.marker_ids:
            arrays[0] = np.concatenate([np.asarray(self.marker_ids, np.int32), arrays[0]])
        total = sum(b.size for b in arrays) + extra_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt of {total - extra_tokens} tokens (+{extra_tokens} to generate) = {total} "
                             f"exceeds the model maximum max_seq_len={self.config.max_seq_len}")
        return arrays

    def block_kv(self, block: np.ndarray, prefix: np.ndarray | None = None) -> KVSegment:
        """The block's KV (batch 1) encoded alone at local positions 0..n-1, or after ``prefix``'s KV (tokens
        encoded alone) at positions P..P+n-1; from the store or one forward over it."""
        p = 0 if prefix is None else prefix.size

        def compute() -> KVSegment:
            cache = self.block_kv(prefix) if p else None
            kv = _padded_forward(self.graphdef, self.state, block, p, cache, self.pad_multiple, keep=1,
                                 width=bucket_length(block.size, self.pad_multiple))[1]   # stored unpadded
            return kv.slice(0, block.size)
        namespace = STORE_NAMESPACE
        if p:
            namespace += "/after:" + hashlib.sha256(np.asarray(prefix, np.int32).tobytes()).hexdigest()[:16]
        return self.store.get_or_compute(block, self.fingerprint, self.dtype, compute, namespace=namespace)

    def assemble(self, blocks: Sequence[np.ndarray], width: int | None = None) -> KVSegment | None:
        """Cached KV of ``blocks`` (the local blocks, in prompt order), each re-encoded to its offset.

        Block b's stored keys sit at local positions 0..n_b-1; re-encoding to its offset o_b is
        ``seg.with_positions(seg.positions + o_b)``, so the concatenated blocks sit at the global
        positions 0..total-1. That positions array is applied once to the concatenation, to keep the
        host dispatches per request independent of the number of blocks.
        The result is right-padded with empty slots (``segment_ids`` 0) to ``width`` tokens (default:
        the next multiple of ``pad_multiple``); None when there are no local blocks and no ``width``.
        """
        p = prefix_length(self.prefix, blocks[0].size) if blocks else 0
        segments = [self.block_kv(block, blocks[0][:p] if i and p else None) for i, block in enumerate(blocks)]
        if self.passage_temperature != 1.0:
            segments[1:] = [s.replace(k=s.k / jnp.asarray(self.passage_temperature, s.k.dtype)) for s in segments[1:]]
        if self.prefix == "nosink":
            segments[1:] = [s.replace(segment_ids=s.segment_ids.at[:, 0].set(0)) for s in segments[1:]]
        total = sum(block.size for block in blocks)
        width = _round_up(total, self.pad_multiple) if width is None else width
        if width < total:
            raise ValueError(f"width={width} is shorter than the {total} cached tokens")
        if width == 0:
            return None
        cfg = self.config
        if width > total:
            segments.append(KVSegment.empty(cfg.num_layers, 1, width - total, cfg.num_kv_heads, cfg.head_dim,
                                            self.dtype))
        slots = np.arange(width, dtype=np.int32)
        return KVSegment.concat(segments).with_positions(np.where(slots < total, slots, 0)[None])

    def prefill(self, blocks: Sequence[Sequence[int]], *, mode: str = "block", last_only: bool = False) -> Prefill:
        """Prefill one prompt: block mode reuses cached blocks, full mode runs one causal forward.

        Args:
          blocks: token-id lists; ``blocks[-1]`` is the last (global) block.
          mode: ``"block"`` or ``"full"``.
          last_only: return the logits of the prompt's last token only (time to first token).

        Returns:
          ``Prefill(logits float32 [len(blocks[-1]) or 1, vocab], cache, kv)`` (see ``Prefill``).

        Raises:
          ValueError: see ``check_blocks``.
        """
        arrays = self.check_blocks(blocks, mode)
        last = arrays[-1]
        keep = 1 if last_only else last.size
        if mode == "full":
            prompt = np.concatenate(arrays)
            logits, kv = _padded_forward(self.graphdef, self.state, prompt, 0, None, self.pad_multiple, keep)
            return Prefill(logits, None, kv)
        cache = self.assemble(arrays[:-1])
        offset = sum(b.size for b in arrays[:-1])
        logits, kv = _padded_forward(self.graphdef, self.state, last, offset, cache, self.pad_multiple, keep)
        return Prefill(logits, cache, kv)

    def generate(self, prompts: Sequence[Sequence[Sequence[int]]], *, max_new_tokens: int, mode: str = "block",
                 eos_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0) -> np.ndarray:
        """Generate after a batch of block prompts; returns int32 ``[batch, max_new_tokens]``.

        Each prompt's blocks before the last become a cache: in block mode the cached passage blocks
        re-encoded to their offsets (``assemble``), in full mode one causal forward over the
        concatenated earlier blocks (exactly full attention, as a prefix cache). Caches are right-padded
        to a common length with empty slots (``segment_ids`` 0, never attended) and the core
        ``generate`` prefills the last blocks after them (positions continue after each row's last
        cached position) and decodes. Cache widths are bucketed (at most 12.5% padding, multiples of
        ``pad_multiple``) and prompts padded (``generate.PROMPT_MULTIPLE``), so compiled shapes stay few.

        Raises:
          ValueError: no prompts, or a prompt fails ``check_blocks`` (with ``max_new_tokens`` counted).
        """
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt (a list of blocks)")
        checked = [self.check_blocks(p, mode, extra_tokens=max_new_tokens) for p in prompts]
        cached = [sum(b.size for b in p[:-1]) for p in checked]
        kv_cache = None
        if max(cached) > 0:
            # Bucketed cache width: batches of similar prompts share compiled shapes; within max_seq_len.
            room = self.config.max_seq_len - max_new_tokens - max(p[-1].size for p in checked)
            least = _round_up(max(cached), self.pad_multiple)
            width = max(min(bucket_length(max(cached), self.pad_multiple), room), least)
            rows = [self.assemble(p[:-1], width) if mode == "block" else self._full_prefix(p[:-1], width)
                    for p in checked]
            kv_cache = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1 if xs[0].ndim == 5 else 0), *rows)
        return core_generate((self.graphdef, self.state), [p[-1].tolist() for p in checked], kv_cache=kv_cache,
                             max_new_tokens=max_new_tokens, eos_id=eos_id, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed)

    def _full_prefix(self, blocks: Sequence[np.ndarray], width: int) -> KVSegment:
        """KV of the concatenated ``blocks`` from one causal forward (positions 0..), padded to ``width``."""
        cfg = self.config
        if not blocks:
            return KVSegment.empty(cfg.num_layers, 1, width, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        kv = _padded_forward(self.graphdef, self.state, np.concatenate(blocks), 0, None, self.pad_multiple, keep=1,
                             width=width)[1]
        if kv.length == width:                                # one forward of the cache's own width
            return kv
        return KVSegment.concat([kv, KVSegment.empty(cfg.num_layers, 1, width - kv.length, cfg.num_kv_heads,
                                                     cfg.head_dim, self.dtype)])
