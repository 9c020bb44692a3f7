"""A byte-bounded LRU store of cached ``KVSegment``s (passage / document KV caches).

Block-Attention (ICLR 2025, §2.3; research note ``shared/research/block_attention.md`` §1.7) reuses
the KV of a passage block across requests: the block is encoded once at local positions 0..n-1 and
its pre-RoPE keys and values are kept; GRIT's caching modes reuse the same store.

An entry is keyed by (namespace, model fingerprint, KV dtype, sha256 of the token ids) and also keeps
the token ids themselves, which a lookup compares, so a hit is never stale: other tokens, another
model (weights or config) or another dtype always miss. The users of the store (Block-Attention,
GRIT caching) take the fingerprint from a ``WeightsFingerprint``, which notices weights changed in
place (``nnx.update``, an optimizer step) and re-hashes them, so after a change lookups miss. The device tier is bounded by
``max_bytes``; with ``host_max_bytes > 0`` entries evicted from it move to a host-memory tier
(NumPy arrays) bounded separately, and a hit there moves the entry back to the device.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.model import KVSegment


def model_fingerprint(model_or_state, config=None) -> str:
    """A sha256 hex digest of a model's parameters (every leaf's bytes, in path order) and its config.

    Any weight or config change gives a different fingerprint. It reads every parameter once (to
    host), so compute it once per model, not per request.

    Args:
      model_or_state: an NNX module or a pytree of arrays (e.g. the ``nnx.State`` from ``nnx.split``).
      config: optional config object (its ``repr`` is hashed; dataclasses print all fields).
    """
    from flax import nnx  # local: the store itself does not need flax

    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    digest = hashlib.sha256(repr(config).encode())
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in leaves:
        array = np.asarray(jax.device_get(leaf))
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class WeightsWatch:
    """Notices weights changed in place: JAX arrays are immutable, so every in-place update of an NNX
    model (``nnx.update``, an optimizer step, ``variable[...] = x``) puts new array objects in its
    variables, which the live ``nnx.State`` from ``nnx.split`` (or the module) shows. ``changed``
    compares the current leaves with the ones seen at the last ``refresh`` by identity (no bytes are
    read); those arrays are held, so their identities cannot be reused by new arrays.

    Args:
      state: the live state (``nnx.split(model)[1]``) or an NNX module.
    """

    def __init__(self, state):
        self._state = state
        self.leaves = self._current()

    def _current(self) -> list:
        from flax import nnx
        state = nnx.state(self._state, nnx.Param) if isinstance(self._state, nnx.Module) else self._state
        return jax.tree_util.tree_leaves(state)

    def changed(self) -> bool:
        """True if a weight array was replaced since the last ``refresh``."""
        leaves = self._current()
        return len(leaves) != len(self.leaves) or any(a is not b for a, b in zip(leaves, self.leaves))

    def refresh(self) -> list:
        """Take the current arrays as seen; returns them."""
        self.leaves = self._current()
        return self.leaves


class WeightsFingerprint:
    """The fingerprint of a model's *current* weights, re-hashed (``model_fingerprint``) only when
    ``WeightsWatch`` sees a weight array replaced.

    Args:
      state: the live state (``nnx.split(model)[1]``) or an NNX module.
      config: hashed with the weights (see ``model_fingerprint``).
      given: a caller's name for the weights at construction (e.g. a checkpoint id), used instead of
        hashing them until the first change; after a change the weights are hashed.
    """

    def __init__(self, state, config=None, given: str | None = None):
        self._state, self._config = state, config
        self._watch = WeightsWatch(state)
        self._value = given or model_fingerprint(state, config)
        self.changes = 0

    def __call__(self) -> str:
        """The fingerprint of the weights as they are now (hex string)."""
        if self._watch.changed():
            self._watch.refresh()
            self._value = model_fingerprint(self._state, self._config)
            self.changes += 1
        return self._value


def cache_key(token_ids: Sequence[int] | np.ndarray, fingerprint: str, dtype, namespace: str = "") -> str:
    """The store key: namespace, fingerprint, dtype name and the sha256 of the int32 token ids."""
    ids = np.asarray(token_ids, np.int32)
    tokens_hash = hashlib.sha256(ids.tobytes()).hexdigest()
    return f"{namespace}|{fingerprint}|{jnp.dtype(dtype).name}|{ids.size}|{tokens_hash}"


@dataclasses.dataclass
class _Entry:
    token_ids: np.ndarray
    segment: KVSegment
    nbytes: int


class KVStore:
    """LRU cache of ``KVSegment``s bounded in bytes, with an optional host-memory tier.

    Args:
      max_bytes: bound on the bytes (``KVSegment.nbytes``) held in the device tier.
      host_max_bytes: bound on the host tier; 0 disables host offload (evicted entries are dropped).
      device: where host-tier hits are moved back to (default: JAX's default device).

    Raises:
      ValueError: a negative bound.
    """

    def __init__(self, max_bytes: int, *, host_max_bytes: int = 0, device: jax.Device | None = None):
        if max_bytes < 0 or host_max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} and host_max_bytes={host_max_bytes} must be >= 0 bytes")
        self.max_bytes = int(max_bytes)
        self.host_max_bytes = int(host_max_bytes)
        self.device = device
        self._device: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._host: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._device_bytes = 0
        self._host_bytes = 0
        self.stats = {"hits": 0, "host_hits": 0, "misses": 0, "evictions": 0, "host_evictions": 0, "rejected": 0}

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    @property
    def nbytes(self) -> int:
        """Bytes held in the device tier."""
        return self._device_bytes

    @property
    def host_nbytes(self) -> int:
        """Bytes held in the host tier."""
        return self._host_bytes

    def clear(self) -> None:
        self._device.clear()
        self._host.clear()
        self._device_bytes = self._host_bytes = 0

    def get(self, token_ids, fingerprint: str, dtype, namespace: str = "") -> KVSegment | None:
        """The cached segment for these tokens/model/dtype, or None. A hit becomes most recently used."""
        key = cache_key(token_ids, fingerprint, dtype, namespace)
        ids = np.asarray(token_ids, np.int32)
        entry = self._device.get(key)
        if entry is not None and np.array_equal(entry.token_ids, ids):
            self._device.move_to_end(key)
            self.stats["hits"] += 1
            return entry.segment
        entry = self._host.get(key)
        if entry is not None and np.array_equal(entry.token_ids, ids):
            segment = jax.device_put(entry.segment, self.device)
            self.stats["host_hits"] += 1
            if entry.nbytes > self.max_bytes:  # too big for the device tier: stays on the host
                self._host.move_to_end(key)
            else:
                self._host_bytes -= self._host.pop(key).nbytes
                self._insert(key, _Entry(entry.token_ids, segment, entry.nbytes))
            return segment
        self.stats["misses"] += 1
        return None

    def put(self, token_ids, fingerprint: str, dtype, segment: KVSegment, namespace: str = "") -> bool:
        """Store ``segment`` (the KV of exactly ``token_ids``); returns False if it exceeds both bounds.

        Raises:
          ValueError: ``segment.k.dtype`` differs from ``dtype``, or its length differs from the
            number of tokens (the key would then describe other content).
        """
        ids = np.array(token_ids, np.int32).reshape(-1)
        if jnp.dtype(segment.k.dtype) != jnp.dtype(dtype):
            raise ValueError(f"segment keys have dtype {segment.k.dtype} but the key says dtype={jnp.dtype(dtype)}")
        if segment.length != ids.size:
            raise ValueError(f"segment length {segment.length} != {ids.size} token ids; a store entry must be "
                             "the KV of exactly its tokens")
        key = cache_key(ids, fingerprint, dtype, namespace)
        self._drop(key)
        entry = _Entry(ids, segment, segment.nbytes)
        if entry.nbytes > self.max_bytes and entry.nbytes > self.host_max_bytes:
            self.stats["rejected"] += 1
            return False
        if entry.nbytes > self.max_bytes:
            self._insert_host(key, entry)
        else:
            self._insert(key, entry)
        return True

    def get_or_compute(self, token_ids, fingerprint: str, dtype, compute: Callable[[], KVSegment],
                       namespace: str = "") -> KVSegment:
        """``get``, or on a miss ``compute()`` the segment, ``put`` it and return it."""
        segment = self.get(token_ids, fingerprint, dtype, namespace)
        if segment is None:
            segment = compute()
            self.put(token_ids, fingerprint, dtype, segment, namespace)
        return segment

    def _insert(self, key: str, entry: _Entry) -> None:
        self._device[key] = entry
        self._device_bytes += entry.nbytes
        while self._device_bytes > self.max_bytes:
            old_key, old = self._device.popitem(last=False)
            self._device_bytes -= old.nbytes
            self.stats["evictions"] += 1
            if self.host_max_bytes:
                self._insert_host(old_key, old)

    def _insert_host(self, key: str, entry: _Entry) -> None:
        if entry.nbytes > self.host_max_bytes:
            return
        host_segment = jax.tree_util.tree_map(np.asarray, jax.device_get(entry.segment))
        self._host[key] = _Entry(entry.token_ids, host_segment, entry.nbytes)
        self._host_bytes += entry.nbytes
        while self._host_bytes > self.host_max_bytes:
            _, old = self._host.popitem(last=False)
            self._host_bytes -= old.nbytes
            self.stats["host_evictions"] += 1

    def _drop(self, key: str) -> None:
        if key in self._device:
            self._device_bytes -= self._device.pop(key).nbytes
        if key in self._host:
            self._host_bytes -= self._host.pop(key).nbytes
