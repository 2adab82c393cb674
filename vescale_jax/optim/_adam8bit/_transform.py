"""8-bit AdamW over :class:`~vescale_jax.ShardedParams`: both moments stored as 8-bit codes with one fp32 scale per
block, every block on one device, so the update is local (no collective).

**Code.** The dynamic-exponent code of :func:`vescale_jax.quant.dynamic_code` (8-bit Adam, Dettmers et al.):
signed for the first moment (int8 codes), unsigned — all 8 bits for magnitude — for the second (uint8). A
linear absmax code would round most of the second moment (values far below their block's maximum) to zero,
and ``m / (sqrt(0) + eps)`` then explodes; the dynamic code has levels down to ``1e-7`` of the block's scale.
Per block ``scale = max|x|`` (fp32); per element ``y = x / scale`` (fp32, ``scale`` 1 for an all-zero block),
``code`` = the nearest level (``jnp.searchsorted`` on the fp32 midpoints, ``side="left"``: a value exactly on a
midpoint takes the lower level), and ``x' = table[code] * scale``. The zero byte decodes to 0.0.

**Blocks** (the layout's block index, :mod:`vescale_jax.layout._blocks`, shared with the FP8 gather). A
floating leaf with at least two dims and at least ``min_size`` elements (per layer, for a stacked leaf) is
quantized in logical ``block[0] × block[1]`` tiles of its last two dims, per leading index, edge tiles partial,
found from each element's storage position with ``vescale_jax.layout._tiles.coords``, so row-major
(``vj.rows``) and tile-major (``vj.tiles``) layouts both work.
Every other floating leaf — vectors (biases, norms) and small matrices, where a block would be most of the
leaf and the scales would cost as much as the codes save — keeps *exact* fp32 moments: each element is its
own block, ``scale = |x|`` and the code is the level ``±1.0``, exact because ``x / |x| = ±1`` and
``±1.0 * |x| = x`` in IEEE arithmetic. A layout that cuts a quantization block across devices (e.g.
``vj.element()`` with a device boundary mid-tile) raises ``ValueError`` when the tables are built (at
construction with ``plan=``, else when ``init`` first sees the params), naming the leaf and the fix; a leaf
that happens to lie on one device is accepted whatever its granularity.

**State.** :class:`ScaleByAdam8bitState`: ``count``, the codes of each moment as a ``ShardedParams`` of int8 /
uint8 buffers (bucket-shaped, sharded like the params, zero at padding), and per bucket one
:class:`vescale_jax.PerDevice` of scales ``(m * L * NB,)``: device ``k`` holds its ``L × NB`` slots (``NB`` the
most blocks any device has in one layer of the bucket; unused slots are 0). A bucket of leaves split over tensor /
expert groups quantizes each group's TP-local tiles: its scales are ``(G * m * L * NB,)``, split over
``(*groups, fsdp)`` like the bucket (``ScaleLayout.groups``). The scales carry a layout
(:class:`ScaleLayout`), so ``vj.optim.logical_view`` / ``vj.checkpoint`` store them per leaf in logical block
order and restore them into a plan with the same blocks.

**Update.** Inside one ``shard_map``: dequantize, the Adam moment updates and bias correction exactly as
``optax.scale_by_adam`` (same functions, fp32), the direction from the fresh fp32 moments, then requantize;
padding stays exactly zero. With every leaf exact (``min_size`` above every leaf's size) the updates equal
``optax.adamw``'s bit for bit on fp32 params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax import quant
from vescale_jax._cache import plan_cache
from vescale_jax.layout import _tp as _tp
from vescale_jax.layout._blocks import BucketBlocks, local_slots
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._adam8bit._blocks import build
from vescale_jax.optim._leaf_tables import check_sharded, is_placeholder, place_state
from vescale_jax.optim._masks import MaskOrFn, add_decayed_weights
from vescale_jax.optim._per_plan import per_plan
from vescale_jax.state._sharded import PerDevice, ShardedParams

__all__ = ["ScaleByAdam8bitState", "ScaleLayout", "adam_8bit_moments", "adamw_8bit", "scale_by_adam_8bit"]

P = jax.sharding.PartitionSpec


class ScaleByAdam8bitState(NamedTuple):
    """State of :func:`scale_by_adam_8bit`.

    Attributes:
      count: steps taken (int32).
      mu_codes: first-moment codes, a ``ShardedParams`` of int8 buffers.
      mu_scales: per bucket, a ``PerDevice`` of fp32 scales ``(G * m * L * NB,)`` (``G`` its TP/EP groups).
      nu_codes: second-moment codes, a ``ShardedParams`` of uint8 buffers.
      nu_scales: per bucket, like ``mu_scales``.
    """

    count: jax.Array
    mu_codes: ShardedParams
    mu_scales: tuple[PerDevice, ...]
    nu_codes: ShardedParams
    nu_scales: tuple[PerDevice, ...]


def _check_block(block: Any, min_size: Any) -> tuple[tuple[int, int], int]:
    block = tuple(block) if isinstance(block, tuple | list) else block
    if (
        not isinstance(block, tuple)
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1 for b in block)
    ):
        raise ValueError(f"vj.optim.adamw_8bit: block must be a (bh, bw) pair of positive ints, got {block!r}.")
    if isinstance(min_size, bool) or not isinstance(min_size, int | np.integer | float) or min_size < 0:
        raise ValueError(f"vj.optim.adamw_8bit: min_size must be a non-negative number, got {min_size!r}.")
    return (int(block[0]), int(block[1])), int(min(min_size, 2**62))


@dataclasses.dataclass(frozen=True)
class ScaleLayout:
    """The rows of one bucket's scales (a ``PerDevice`` ``(m * L * NB,)``) and their plan-independent form.

    Logical form: per leaf of the bucket, key ``"<path>/scales"``: a quantized leaf's block scales at
    ``(*lead, ceil(p / bh), ceil(q / bw))`` (with the layer dim first for a stacked leaf) in logical block
    order; an exact leaf's per-element scales (``|moment|``) at its shape. A leaf split over tensor / expert
    groups is quantized in tiles of its TP-local shard (whose split dims are block multiples); its logical scales
    are the groups' grids put side by side like the leaf: the FSDP-only plan's.

    Attributes:
      plan: the plan.
      bucket: the bucket's index.
      block: ``(bh, bw)``.
      min_size: the smallest quantized leaf (per layer).
    """

    supports_groups = True  # its logical view assembles the groups' grids (see to_logical)

    plan: Plan
    bucket: int
    block: tuple[int, int]
    min_size: int

    def default_dtype(self) -> Any:
        return jnp.float32

    @property
    def groups(self) -> tuple[str, ...]:
        """The tensor / expert mesh axes the bucket's scales differ over (``()`` for an ungrouped bucket)."""
        return self.plan.buckets[self.bucket].groups

    @property
    def axes(self) -> tuple[str, ...] | None:
        """The mesh axes the scales' dim 0 is split over (``PerDevice.axes``): the bucket's, ``(*groups,
        fsdp)``, for a grouped bucket; ``None`` (the plan's axis) otherwise."""
        b = self.plan.buckets[self.bucket]
        return self.plan.bucket_axes(b) if b.groups else None

    def _entries(self) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
        return _scale_entries(self.plan, self.bucket, self.block, self.min_size)

    def logical_shapes(self, dtype: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
        """``{key: ShapeDtypeStruct}`` of :meth:`to_logical` (replicated)."""
        dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
        rep = jax.sharding.NamedSharding(self.plan.mesh, P())
        return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=rep) for key, shape in _logical_shapes(self).items()}

    def to_logical(self, value: jax.Array) -> dict[str, jax.Array]:
        """The scales of each leaf in logical block order (exact: a permutation of the used slots)."""
        entries = self._entries()
        if not entries:
            return {}
        value = jax.device_put(value, jax.sharding.NamedSharding(self.plan.mesh, P()))  # scales are small
        return dict(zip([e[0] for e in entries], _to_logical_fn(self)(value), strict=True))

    def from_logical(self, arrays: Mapping[str, jax.Array]) -> jax.Array:
        """The ``PerDevice`` value under this layout's plan from :meth:`to_logical`'s arrays (unused slots 0)."""
        entries = self._entries()
        keys = [e[0] for e in entries]
        missing, extra = [k for k in keys if k not in arrays], [k for k in arrays if k not in keys]
        if missing or extra:
            raise ValueError(
                f"ScaleLayout.from_logical: missing keys {missing[:5]}, unexpected keys {extra[:5]}; the arrays come "
                "from another tree or another adamw_8bit configuration (block, min_size)."
            )
        for key, shape in _logical_shapes(self).items():
            if tuple(arrays[key].shape) != shape:
                raise ValueError(
                    f"ScaleLayout.from_logical: {key!r} has shape {tuple(arrays[key].shape)}, expected {shape} "
                    f"(block {self.block}); restore with the block the state was saved with."
                )
        rep = jax.sharding.NamedSharding(self.plan.mesh, P())
        return _from_logical_fn(self)(*[jax.device_put(jnp.asarray(arrays[k], jnp.float32), rep) for k in keys])


@plan_cache
def _scale_entries(plan: Plan, bucket: int, block: tuple[int, int], min_size: int):
    """``[(key, logical shape, global value index of each logical scale)]`` of one bucket's leaves."""
    t = build(plan, block, min_size)[bucket]
    layers, nb = t.layers, t.nb
    out = []
    for j, lb in enumerate(t.leaves):
        device, slot = t.placement(j)  # of each logical block
        logical = device * layers * nb + slot
        index = logical[None] + nb * np.arange(layers, dtype=np.int64)[:, None]  # (L, blocks)
        spec = plan.leaves[lb.leaf]
        shape = lb.grid if plan.buckets[bucket].layers is None else (layers, *lb.grid)
        out.append((f"{spec.path}/scales", tuple(shape), index.reshape(-1)))
    return out


def _group_size(layout: ScaleLayout) -> int:
    """Scale slots of one TP/EP group of the bucket (``m * L * NB``)."""
    t = build(layout.plan, layout.block, layout.min_size)[layout.bucket]
    return layout.plan.num_devices * t.layers * t.nb


def _grid_dims(layout: ScaleLayout) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Per entry of a grouped bucket: the TP/EP axes of each dim of its scale grid, the leaf's (its shards'
    split dims are block multiples: :func:`vescale_jax.layout._blocks.block_index` checks it)."""
    plan = layout.plan
    t = build(plan, layout.block, layout.min_size)[layout.bucket]
    return {f"{plan.leaves[lb.leaf].path}/scales": plan.leaves[lb.leaf].tp for lb in t.leaves}


@plan_cache
def _logical_shapes(layout: ScaleLayout) -> dict[str, tuple[int, ...]]:
    entries = layout._entries()
    if not layout.groups:
        return {key: shape for key, shape, _ in entries}
    sizes = dict(layout.plan.mesh.shape)
    dims = _grid_dims(layout)
    out = {}
    for key, shape, _ in entries:
        d = dims[key]
        out[key] = tuple(n * int(np.prod([sizes[a] for a in axes])) for n, axes in zip(shape, d, strict=True))
    return out


@plan_cache
def _to_logical_fn(layout: ScaleLayout):
    entries = layout._entries()
    rep = jax.sharding.NamedSharding(layout.plan.mesh, P())
    groups = layout.groups
    if groups:
        sizes = dict(layout.plan.mesh.shape)
        dims, shapes = _grid_dims(layout), _logical_shapes(layout)
        num, step = layout.plan.buckets[layout.bucket].num_groups, _group_size(layout)

    def f(value):
        if not groups:
            return tuple(jnp.reshape(jnp.take(value, jnp.asarray(idx)), shape) for _, shape, idx in entries)
        out = []
        for key, shape, idx in entries:
            blocks = [jnp.reshape(jnp.take(value, jnp.asarray(idx + g * step)), shape) for g in range(num)]
            out.append(_tp.assemble(blocks, shapes[key], dims[key], groups, sizes))
        return tuple(out)

    return jax.jit(f, out_shardings=tuple(rep for _ in entries))


@plan_cache
def _from_logical_fn(layout: ScaleLayout):
    plan, entries = layout.plan, layout._entries()
    step, groups = _group_size(layout), layout.groups
    num = plan.buckets[layout.bucket].num_groups
    out = jax.sharding.NamedSharding(plan.mesh, P(layout.axes or plan.axis))
    sizes = dict(plan.mesh.shape)
    dims = _grid_dims(layout) if groups else {}

    def f(*xs):
        value = jnp.zeros((num * step,), jnp.float32)
        for (key, _, idx), x in zip(entries, xs, strict=True):
            for g in range(num):
                part = _tp.local_block(x, dims[key], _tp.group_coords(g, groups, sizes), sizes) if groups else x
                value = value.at[jnp.asarray(idx + g * step)].set(jnp.reshape(part, (-1,)))
        return value

    return jax.jit(f, out_shardings=out)


def _local_dequant(codes, scales, slots, t: BucketBlocks, signed: bool) -> jax.Array:
    """fp32 moments of one bucket's local shard from its codes and ``(L * NB,)`` local scales."""
    table = jnp.concatenate([jnp.reshape(scales, (t.layers, t.nb)), jnp.zeros((t.layers, 1), jnp.float32)], 1)
    per = jnp.take(table, slots, axis=1)  # (L, S)
    x = quant.dynamic_decode(codes, signed=signed) * jnp.reshape(per, codes.shape)
    return x


def _local_quant(x, slots, t: BucketBlocks, signed: bool) -> tuple[jax.Array, jax.Array]:
    """``(codes, (L * NB,) scales)`` of one bucket's fp32 local moments ``x`` (padding already zero)."""
    x2 = jnp.reshape(x, (t.layers, -1))
    absmax = jax.vmap(lambda a: jax.ops.segment_max(a, slots, num_segments=t.nb + 1))(jnp.abs(x2))
    scales = jnp.maximum(absmax[:, : t.nb], jnp.float32(0))  # empty slots: -inf -> 0
    full = jnp.concatenate([scales, jnp.ones((t.layers, 1), jnp.float32)], 1)
    per = jnp.take(jnp.where(full > 0, full, jnp.float32(1)), slots, axis=1)
    codes = quant.dynamic_encode(x2 / per, signed=signed)
    codes = jnp.where(slots[None] < t.nb, codes, jnp.zeros((), codes.dtype))
    return jnp.reshape(codes, x.shape), jnp.reshape(scales, (-1,))


def adam_direction(mu, nu, count, *, b1, b2, eps, eps_root) -> jax.Array:
    """Adam's bias-corrected direction ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``, each moment times the fp32
    reciprocal of ``1 - b ** count``: what XLA compiles ``optax.scale_by_adam``'s division by that scalar into
    (written out so that no fusion context can choose another association)."""
    r1 = (1 / (1 - b1**count)).astype(jnp.float32)
    r2 = (1 / (1 - b2**count)).astype(jnp.float32)
    return mu * r1 / (jnp.sqrt(nu * r2 + eps_root) + eps)


def _per_device(plan: Plan, b: int, value: Any, block, min_size) -> PerDevice:
    return PerDevice(value, plan, ScaleLayout(plan, b, block, min_size))


def _scale_specs(plan: Plan, block, min_size) -> tuple[Any, ...]:
    """Per bucket, the ``PartitionSpec`` of its scales: over the plan's axis, or ``(*groups, fsdp)``."""
    return tuple(P(ScaleLayout(plan, b, block, min_size).axes or plan.axis) for b in range(len(plan.buckets)))


def scale_by_adam_8bit(
    *,
    plan: Plan | None = None,
    block: tuple[int, int] = (32, 32),
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    min_size: int = 4096,
) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with both moments stored 8-bit, block-quantized on each device's own blocks.

    Args:
      plan: optional: the plan of the params (default: read from the params it sees, the block tables built
        when ``init`` / ``update`` first sees them; given, they must carry it). Its layout must keep every
        quantization block on one device.
      block: ``(bh, bw)``: quantization tile of the last two dims of each quantized leaf.
      b1, b2, eps, eps_root: as in ``optax.scale_by_adam``.
      min_size: leaves with fewer elements per layer (and leaves of fewer than two dims) keep exact fp32
        moments (one-element blocks).

    Returns:
      A transformation over ``ShardedParams`` of ``plan``; state :class:`ScaleByAdam8bitState`.

    Raises:
      ValueError: when the plan's layout puts a device boundary inside a quantization block (naming the
        leaf, its shape, the block, its granularity and the fix), or for a non-floating leaf.

    Sharding:
      Codes like the buckets, scales per device; the update is one ``shard_map`` with no collective.
    """
    block, min_size = _check_block(block, min_size)
    build = lambda p: _scale_by_adam_8bit(p, block, min_size, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return per_plan(build, plan, "adamw_8bit")


def _scale_by_adam_8bit(plan: Plan, block, min_size, *, b1, b2, eps, eps_root) -> optax.GradientTransformation:
    """:func:`scale_by_adam_8bit` over ``plan`` (options checked)."""
    bad = [s for s in plan.leaves if not jnp.issubdtype(jnp.dtype(s.dtype), jnp.floating)]
    if bad:
        raise ValueError(
            f"vj.optim.adamw_8bit: leaf {bad[0].path!r} has dtype {bad[0].dtype}; Adam needs floating leaves. "
            "Leave it out with vj.optim.partition(..., param_labels) and optax.set_to_zero()."
        )
    tables = build(plan, block, min_size)
    m, axis = plan.num_devices, plan.axis

    def init_fn(params):
        if is_placeholder(params):
            raise TypeError("vj.optim.adamw_8bit: init needs the vj.ShardedParams (its state depends on the plan).")
        check_sharded(params, plan, "adamw_8bit")
        mu = ShardedParams([jnp.zeros(b.shape, jnp.int8) for b in plan.buckets], plan)
        nu = ShardedParams([jnp.zeros(b.shape, jnp.uint8) for b in plan.buckets], plan)
        scales = lambda: tuple(
            _per_device(plan, i, jnp.zeros((b.num_groups * m * t.layers * t.nb,), jnp.float32), block, min_size)
            for i, (t, b) in enumerate(zip(tables, plan.buckets, strict=True))
        )
        state = ScaleByAdam8bitState(jnp.zeros([], jnp.int32), mu, scales(), nu, scales())
        return place_state(state, plan)

    def update_fn(updates, state, params=None):
        del params
        check_sharded(updates, plan, "adamw_8bit")
        count_inc = optax.safe_increment(state.count)
        specs = tuple(plan.partition_spec(b) for b in plan.buckets)

        def local(count, grads, mu_c, mu_s, nu_c, nu_s):
            ups, out = [], ([], [], [], [])
            for b, t in enumerate(tables):
                slots = local_slots(t, jax.lax.axis_index(axis), plan.buckets[b].layout.shard_size, xp=jnp)
                g = grads[b].astype(jnp.float32)
                keep = jnp.broadcast_to(slots < t.nb, g.shape)
                mu = _local_dequant(mu_c[b], mu_s[b], slots, t, True)
                nu = _local_dequant(nu_c[b], nu_s[b], slots, t, False)
                mu = optax.tree.update_moment(g, mu, b1, 1)
                nu = optax.tree.update_moment_per_elem_norm(g, nu, b2, 2)
                u = adam_direction(mu, nu, count, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
                zero = jnp.zeros((), jnp.float32)
                ups.append(jnp.where(keep, u, zero).astype(grads[b].dtype))
                for j, (x, signed) in enumerate(((mu, True), (nu, False))):
                    codes, scales = _local_quant(jnp.where(keep, x, zero), slots, t, signed)
                    out[2 * j].append(codes)
                    out[2 * j + 1].append(scales)
            return tuple(ups), *(tuple(o) for o in out)

        flat = _scale_specs(plan, block, min_size)
        mapped = jax.shard_map(
            local,
            mesh=plan.mesh,
            in_specs=(P(), specs, specs, flat, specs, flat),
            out_specs=(specs, specs, flat, specs, flat),
            check_vma=False,
        )
        ups, mu_c, mu_s, nu_c, nu_s = mapped(
            count_inc,
            tuple(updates.buffers),
            tuple(state.mu_codes.buffers),
            tuple(s.value for s in state.mu_scales),
            tuple(state.nu_codes.buffers),
            tuple(s.value for s in state.nu_scales),
        )
        scales = lambda vs: tuple(_per_device(plan, i, v, block, min_size) for i, v in enumerate(vs))
        new = ScaleByAdam8bitState(
            count_inc, ShardedParams(mu_c, plan), scales(mu_s), ShardedParams(nu_c, plan), scales(nu_s)
        )
        return ShardedParams(ups, plan), new

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(
    learning_rate: optax.ScalarOrSchedule,
    *,
    plan: Plan | None = None,
    block: tuple[int, int] = (32, 32),
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: MaskOrFn | None = None,
    min_size: int = 4096,
) -> optax.GradientTransformationExtraArgs:
    """``optax.adamw`` with 8-bit block-quantized moments (see the module docstring).

    Args:
      learning_rate: a scalar or schedule.
      plan: optional: the params' plan (default: read from the params it sees).
      block: ``(bh, bw)`` quantization tile.
      b1, b2, eps, eps_root: as in ``optax.adamw``.
      weight_decay: decoupled weight decay (a scalar or schedule).
      mask: weight-decay mask over the logical tree, as in :func:`vescale_jax.optim.adamw`.
      min_size: smaller leaves (per layer) keep exact fp32 moments.

    Returns:
      ``chain(scale_by_adam_8bit, add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``.
    """
    return optax.chain(
        scale_by_adam_8bit(plan=plan, block=block, b1=b1, b2=b2, eps=eps, eps_root=eps_root, min_size=min_size),
        add_decayed_weights(weight_decay, mask, plan=plan),
        optax.scale_by_learning_rate(learning_rate),
    )


def _find_state(state: Any) -> ScaleByAdam8bitState:
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ScaleByAdam8bitState))
        if isinstance(x, ScaleByAdam8bitState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"vj.optim.adam_8bit_moments: expected one ScaleByAdam8bitState in the state, found {len(found)}."
        )
    return found[0]


def adam_8bit_moments(state: Any) -> tuple[ShardedParams, ShardedParams]:
    """The dequantized fp32 moments ``(mu, nu)`` of an :func:`adamw_8bit` state, as ``ShardedParams``.

    Args:
      state: the optimizer state (a :class:`ScaleByAdam8bitState` or a chain holding one).

    Returns:
      ``(mu, nu)`` sharded like the params (``vj.unshard`` gives the logical trees); padding zero.
    """
    s = _find_state(state)
    plan = s.mu_codes.plan
    layout = s.mu_scales[0].layout
    tables = build(plan, layout.block, layout.min_size)
    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    flat = _scale_specs(plan, layout.block, layout.min_size)

    def local(mu_c, mu_s, nu_c, nu_s):
        mus, nus = [], []
        for b, t in enumerate(tables):
            slots = local_slots(t, jax.lax.axis_index(plan.axis), plan.buckets[b].layout.shard_size, xp=jnp)
            mus.append(_local_dequant(mu_c[b], mu_s[b], slots, t, True))
            nus.append(_local_dequant(nu_c[b], nu_s[b], slots, t, False))
        return tuple(mus), tuple(nus)

    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(specs, flat, specs, flat), out_specs=(specs, specs))
    mu, nu = jax.jit(mapped)(
        tuple(s.mu_codes.buffers),
        tuple(x.value for x in s.mu_scales),
        tuple(s.nu_codes.buffers),
        tuple(x.value for x in s.nu_scales),
    )
    return ShardedParams(mu, plan), ShardedParams(nu, plan)
