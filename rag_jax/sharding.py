"""Device mesh from config and the logical-axis rules table (MaxText style).

Parameters carry logical axis names (``vocab, embed, mlp, heads, kv_heads, head_dim, norm``, set by the
core model via ``nnx.Param(..., sharding_names=...)``); batches use ``batch`` and ``seq``. One ordered
rules table maps each logical name to mesh axes; a mesh axis of size 1, an axis already used by an
earlier dimension of the same array, or an axis whose size does not divide the dimension drops out,
so one table serves 1 CPU up to a pod (research note jax_frameworks.md sections 1.1 and 6.3).

FSDP = ``embed`` over ``fsdp``; tensor parallelism = ``heads``/``kv_heads``/``mlp``/``vocab`` over
``tensor``; data parallelism = ``batch`` over ``data`` (and ``fsdp``, ZeRO-3 style: FSDP shards params
and the batch alike). Activations use ``batch``, ``seq`` and ``activation_embed`` (the hidden width of
activations, over ``tensor`` only: MaxText's ``activation_embed``), applied with ``constrain`` inside
``activation_rules``; without such hints GSPMD may keep a large activation sharded like a parameter
(over ``fsdp`` on its width) and replicate it over the batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Ordered: for each array dimension the first rule naming its logical axis that still yields a usable
# mesh axis wins; later rules for the same name are fallbacks.
Rules = tuple[tuple[str, tuple[str, ...]], ...]
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("seq", ()),
    ("activation_embed", ("tensor",)),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("norm", ()),
    ("layers", ()),  # the stacked axis of scanned layers (ModelConfig.scan_layers): each chip holds every layer
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1 = "all remaining devices".

    Attributes:
      data: pure data parallelism (params replicated).
      fsdp: fully sharded data parallelism (params, grads, optimizer state sharded over it; batch too).
      tensor: tensor (model) parallelism over heads / MLP / vocab.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}


def resolve_axis_sizes(config: MeshConfig, num_devices: int) -> dict[str, int]:
    """Replace a -1 with the remaining device count.

    Raises:
      ValueError: more than one -1, a size of 0 or < -1, or a product that does not equal num_devices.
    """
    sizes = config.sizes()
    bad = {k: v for k, v in sizes.items() if v == 0 or v < -1}
    if bad:
        raise ValueError(f"mesh sizes {bad} must be positive or -1 (fill)")
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1 (fill); got {fill} in {sizes}")
    known = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if num_devices % known:
            raise ValueError(f"mesh {sizes}: the fixed axes (product {known}) do not divide the {num_devices} "
                             f"devices, so '{fill[0]}=-1' cannot fill them")
        sizes[fill[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {sizes} has {math.prod(sizes.values())} devices but {num_devices} are available; "
                         "make data*fsdp*tensor equal the device count or set one axis to -1")
    return sizes


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data x fsdp x tensor`` mesh (GSPMD ``Auto`` axis types) over ``devices`` (default all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(config, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(names: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES,
                    shape: Sequence[int] | None = None) -> P:
    """Map logical axis names (one per array dim) to a mesh ``PartitionSpec``.

    A mesh axis is used for a dimension only if its size is > 1, no earlier dimension of the array
    uses it, and (when ``shape`` is given) the product of the chosen axes divides the dimension.

    Raises:
      ValueError: a logical name has no rule (typo guard), or len(shape) != len(names).
    """
    known = {name for name, _ in rules}
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical names {tuple(names)} do not match array shape {tuple(shape)}")
    used: set[str] = set()
    out = []
    for dim, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in known:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(known)}")
        chosen: list[str] = []
        for rule_name, axes in rules:
            if rule_name != name:
                continue
            product = 1
            for axis in axes:
                size = mesh.shape.get(axis, 1)
                if size == 1 or axis in used:
                    continue
                if shape is not None and shape[dim] % (product * size):
                    continue
                chosen.append(axis)
                product *= size
            if chosen:
                break
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*out)


def logical_sharding(names: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES,
                     shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, mesh, rules, shape))


def tree_shardings(abstract_tree, logical_specs, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs from a matching pytree of logical
    ``PartitionSpec``s (e.g. ``nnx.get_partition_spec(params)``); a leaf without names is replicated."""
    def one(x, spec):
        names = tuple(spec) if spec is not None else (None,) * len(x.shape)
        names = names + (None,) * (len(x.shape) - len(names))
        return logical_sharding(names, mesh, rules, x.shape)
    return jax.tree.map(one, abstract_tree, logical_specs, is_leaf=lambda s: isinstance(s, P) or s is None)


def data_parallel_size(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """Number of shards of the ``batch`` axis (the global batch must be a multiple of it)."""
    spec = logical_to_spec(("batch",), mesh, rules)
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
    return math.prod(mesh.shape[a] for a in axes)


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of a ``[batch, seq, ...]`` input array: batch over the data-parallel axes."""
    return logical_sharding(("batch",) + (None,) * (ndim - 1), mesh, rules)


def check_global_batch(global_batch: int, mesh: Mesh, rules: Rules = DEFAULT_RULES, accum_steps: int = 1) -> None:
    """Raises ValueError unless global_batch is a multiple of data-parallel size x accum_steps, and, where the
    batch is split over two or more mesh axes and ``tensor`` splits the width too, unless each shard of a
    micro-batch holds at least two rows: with one row per shard there XLA's partitioner (jax 0.10) returns
    wrong activations for some rows (``x + f(x)`` with ``x`` constrained to ``P(("data", "fsdp"), None,
    "tensor")``, mesh 2 x 2 x 2, 4 rows: rows 1 and 2 wrong; ``tests/test_sharding.py`` keeps the reproduction)."""
    dp = data_parallel_size(mesh, rules)
    if global_batch < 1 or global_batch % (dp * accum_steps):
        raise ValueError(f"global batch size {global_batch} must be a positive multiple of the data-parallel size "
                         f"{dp} (mesh {dict(mesh.shape)}) x grad_accum_steps {accum_steps} = {dp * accum_steps}")
    spec = logical_to_spec(("batch",), mesh, rules)[0]
    if (isinstance(spec, tuple) and len(spec) > 1 and mesh.shape.get("tensor", 1) > 1
            and global_batch // (dp * accum_steps) == 1):
        raise ValueError(f"global batch size {global_batch} puts one row per data-parallel shard of mesh "
                         f"{dict(mesh.shape)} (batch over {spec}, tensor > 1), where XLA's partitioner computes "
                         f"wrong activations; use at least 2 rows per shard: a multiple of {2 * dp * accum_steps}")


# Activation constraints: a no-op unless code runs inside `activation_rules(mesh, rules)`, so model code
# can annotate activations without depending on a mesh.
_ACTIVE: list[tuple[Mesh, Rules]] = []


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> tuple[Mesh, Rules] | None:
    """The ``(mesh, rules)`` of the innermost ``activation_rules`` context, or None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names, e.g. ``constrain(h, ("batch", "seq", "embed"))``."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, logical_sharding(names, mesh, rules, x.shape))


def describe(shardings) -> dict[str, str]:
    """``{"path/to/leaf": "PartitionSpec(...)"}`` for logs and golden files."""
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): str(s.spec) for path, s in flat}


def host_local_batch_slice(global_batch: int) -> slice:
    """Rows of the global batch this process feeds (contiguous, process-index order).

    ``jax.make_array_from_process_local_data`` assembles the global array from these host slices.
    """
    n, i = jax.process_count(), jax.process_index()
    if global_batch % n:
        raise ValueError(f"global batch size {global_batch} must be divisible by the {n} processes")
    per = global_batch // n
    return slice(i * per, (i + 1) * per)


def to_global(batch: dict[str, np.ndarray], mesh: Mesh, global_batch: int, rules: Rules = DEFAULT_RULES) -> dict:
    """Host-local numpy batch (this process's rows) -> global sharded ``jax.Array``s."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim, rules), v,
                                                      (global_batch,) + v.shape[1:])
            for k, v in batch.items()}
