"""vescale_jax.testing: collective census, memory and cost of compiled programs, and the HLO parser on snippets."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax import testing as vt

F32 = 4  # bytes per f32 element
S = 24  # local shard length: divisible by 3, 4 and 8


FSDP = P("fsdp")


def _compile(f, mesh, *args, in_specs=FSDP, out_specs=FSDP, donate=()):
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs), donate_argnums=donate)
    return fn.lower(*args).compile()


def _local_vector(m, n=S):
    return jnp.asarray(np.random.default_rng(m).standard_normal(m * n), jnp.float32)


def _only(census, kind):
    (op,) = census.of(kind)
    return op


# ---------------------------------------------------------------------------------------------------------------
# Compiled programs on simulated CPU devices
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [3, 8])
def test_all_gather_count_bytes_and_wire(m):
    mesh = make_mesh(m, auto=True)
    compiled = _compile(lambda v: jax.lax.all_gather(v, "fsdp", tiled=True), mesh, _local_vector(m))
    c = vt.census(compiled)
    assert c.count("all-gather") == c.instructions("all-gather") == 1
    assert c.bytes("all-gather") == F32 * m * S
    assert c.wire_bytes("all-gather") == F32 * S * (m - 1)
    op = _only(c, "all-gather")
    assert (op.group_size, op.multiplier, op.in_loop, op.is_async) == (m, 1, False, False)
    assert op.shape == f"f32[{m * S}]"
    for kind in ("reduce-scatter", "all-reduce", "all-to-all", "collective-permute"):
        assert c.count(kind) == 0 and c.bytes(kind) == 0 and c.wire_bytes(kind) == 0
        assert c.largest(kind) is None


@pytest.mark.parametrize("m", [3, 8])
def test_psum_scatter_is_a_reduce_scatter(m):
    mesh = make_mesh(m, auto=True)
    compiled = _compile(lambda v: jax.lax.psum_scatter(v, "fsdp", tiled=True), mesh, _local_vector(m))
    c = vt.census(compiled)
    b = F32 * S // m  # result: one m-th of the local vector
    assert c.count("reduce-scatter") == 1
    assert c.bytes("reduce-scatter") == b
    assert c.wire_bytes("reduce-scatter") == b * (m - 1)
    assert _only(c, "reduce-scatter").group_size == m
    assert c.count("all-reduce") == 0


@pytest.mark.parametrize("m", [3, 8])
def test_psum_of_a_vector_is_an_all_reduce(m):
    mesh = make_mesh(m, auto=True)
    compiled = _compile(lambda v: jax.lax.psum(v, "fsdp"), mesh, _local_vector(m))
    c = vt.census(compiled)
    b = F32 * S
    assert c.count("all-reduce") == 1
    assert c.bytes("all-reduce") == b
    assert c.wire_bytes("all-reduce") == pytest.approx(2 * b * (m - 1) / m)


def test_all_to_all_tuple_result_and_collective_permute():
    m = 8
    mesh = make_mesh(m, auto=True)

    def f(v):
        t = jax.lax.all_to_all(v.reshape(m, -1), "fsdp", 0, 0, tiled=True).reshape(-1)
        return jax.lax.ppermute(t, "fsdp", [(i, (i + 1) % m) for i in range(m)])

    c = vt.census(_compile(f, mesh, _local_vector(m)))
    a2a = _only(c, "all-to-all")  # XLA:CPU splits it into an m-tuple of f32[1, S/m]: the elements are summed
    assert a2a.result_bytes == F32 * S and a2a.group_size == m
    assert c.wire_bytes("all-to-all") == F32 * S * (m - 1) / m
    perm = _only(c, "collective-permute")
    assert perm.result_bytes == F32 * S and perm.group_size == m
    assert c.wire_bytes("collective-permute") == F32 * S
    assert c.total_wire_bytes == c.wire_bytes("all-to-all") + c.wire_bytes("collective-permute")


def _gather_step(c):
    """A carried dependency on the gathered value, so XLA cannot hoist or drop the all-gather."""
    g = jax.lax.all_gather(c, "fsdp", tiled=True)
    return c * 0.5 + g.reshape(-1, c.shape[0]).sum(0)


def test_fori_loop_multiplies_by_trip_count():
    m, n = 8, 5
    mesh = make_mesh(m, auto=True)
    compiled = _compile(lambda v: jax.lax.fori_loop(0, n, lambda i, c: _gather_step(c), v), mesh, _local_vector(m))
    assert " while(" in compiled.as_text()  # XLA:CPU keeps the loop (a trip count of 1 would be removed)
    c = vt.census(compiled)
    op = _only(c, "all-gather")
    assert (op.multiplier, op.in_loop, op.unknown_trip_count) == (n, True, False)
    assert c.instructions("all-gather") == 1
    assert c.count("all-gather") == n
    assert c.bytes("all-gather") == n * F32 * m * S
    assert c.wire_bytes("all-gather") == n * F32 * S * (m - 1)
    assert c.unknown_trip_counts == ()
    assert "all-gather" in str(c) and "f32[192]" in c.table(ops=True)


def test_nested_scans_multiply():
    m, outer, inner = 8, 3, 4
    mesh = make_mesh(m, auto=True)

    def f(v):
        def outer_body(c, _):
            c = jax.lax.scan(lambda c2, _: (_gather_step(c2), None), c, None, length=inner)[0]
            return c + jax.lax.psum(c, "fsdp") * 0.1, None

        return jax.lax.scan(outer_body, v, None, length=outer)[0]

    c = vt.census(_compile(f, mesh, _local_vector(m)))
    assert _only(c, "all-gather").multiplier == outer * inner
    assert _only(c, "all-reduce").multiplier == outer
    assert c.count("all-gather") == outer * inner
    assert c.bytes("all-reduce") == outer * F32 * S


def test_dynamic_trip_count_is_flagged_and_counted_once():
    m = 8
    mesh = make_mesh(m, auto=True)

    def f(v, n):
        return jax.lax.fori_loop(0, n[0], lambda i, c: _gather_step(c), v)

    compiled = _compile(f, mesh, _local_vector(m), jnp.array([3], jnp.int32), in_specs=(P("fsdp"), P()))
    c = vt.census(compiled)
    op = _only(c, "all-gather")
    assert (op.multiplier, op.in_loop, op.unknown_trip_count) == (1, True, True)
    assert len(c.unknown_trip_counts) == 1
    assert "unknown trip count" in c.table()


def test_two_dimensional_mesh_group_sizes():
    if len(jax.devices()) < 8:
        pytest.skip(f"needs 8 devices, {len(jax.devices())} available")
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    x = jnp.ones((8 * S,), jnp.float32)
    spec = P(("a", "b"))

    def f(v):
        return jax.lax.all_gather(v, "b", tiled=True), jax.lax.all_gather(v, "a", tiled=True)

    c = vt.census(_compile(f, mesh, x, in_specs=spec, out_specs=(spec, spec)))
    by_size = {op.group_size: op for op in c.of("all-gather")}
    assert set(by_size) == {2, 4}
    for g, op in by_size.items():
        assert op.result_bytes == F32 * S * g
        assert op.wire_bytes == F32 * S * (g - 1)
    assert c.largest("all-gather") is by_size[4]
    assert c.wire_bytes("all-gather") == F32 * S * (4 - 1 + 2 - 1)


def test_memory_with_donation():
    m = 8
    mesh = make_mesh(m, auto=True)
    x = _local_vector(m)
    compiled = _compile(lambda v: jax.lax.psum(v, "fsdp") * 2.0, mesh, x, donate=(0,))
    mem = vt.memory(compiled)
    assert mem.argument == F32 * S and mem.output == F32 * S  # per device
    assert mem.alias == F32 * S  # donated input reused for the output
    raw = compiled.memory_analysis()
    assert mem.temp == raw.temp_size_in_bytes
    assert mem.peak == mem.argument + mem.output - mem.alias + mem.temp
    assert mem.mib()["peak"] == mem.peak / 2**20
    assert "peak" in str(mem)


def test_memory_accepts_a_plain_mapping_and_rejects_none():
    class Fake:
        def __init__(self, stats):
            self.stats = stats

        def memory_analysis(self):
            return self.stats

    stats = {"argument_size_in_bytes": 10, "output_size_in_bytes": 6, "alias_size_in_bytes": 4}
    stats |= {"temp_size_in_bytes": 3, "peak_memory_in_bytes": 12}
    mem = vt.memory(Fake(stats))
    assert (mem.peak, mem.reported_peak, mem.generated_code) == (10 + 6 - 4 + 3, 12, 0)
    with pytest.raises(ValueError, match="no memory analysis"):
        vt.memory(Fake(None))


def test_cost_dict_and_list_forms():
    mesh = make_mesh(8, auto=True)
    compiled = _compile(lambda v: jnp.tanh(v) * v, mesh, _local_vector(8))
    got = vt.cost(compiled)
    assert set(got) == {"flops", "bytes_accessed", "transcendentals"}
    assert got["flops"] > 0 and got["bytes_accessed"] >= 2 * F32 * S  # reads and writes the local vector

    class Fake:
        def __init__(self, raw):
            self.raw = raw

        def cost_analysis(self):
            return self.raw

    assert vt.cost(Fake([{"flops": 3.0, "bytes accessed": 8.0}]))["flops"] == 3.0
    assert vt.cost(Fake({"bytes accessed": 8.0})) == {"flops": 0.0, "bytes_accessed": 8.0, "transcendentals": 0.0}
    assert vt.cost(Fake(None))["flops"] == 0.0


def test_census_accepts_text_and_rejects_stablehlo():
    mesh = make_mesh(8, auto=True)
    fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "fsdp"), mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))
    lowered = fn.lower(_local_vector(8))
    compiled = lowered.compile()
    assert vt.census(compiled.as_text()) == vt.census(compiled)
    with pytest.raises(ValueError, match="StableHLO"):
        vt.census(lowered.as_text())
    with pytest.raises(TypeError):
        vt.census(42)


# ---------------------------------------------------------------------------------------------------------------
# Hand-written HLO snippets
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "size"),
    [
        ("channel_id=1, replica_groups={{0,1,2},{3,4,5}}, dimensions={0}", 3),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true", 2),
        ("channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}", 4),
        ("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", 2),
        ("replica_groups=[1,8]<=[8]", 8),
        ("replica_groups={{0,1,2,3,4,5,6,7}}", 8),
        # The mesh-axes form printed by newer XLA (JAX 0.11): product of the named axes' sizes.
        ("channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'a'}, use_global_device_ids=true", 2),
        ("replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}", 4),
        ("replica_groups=mesh['a'=2,'b'=4] {'a','b'}, to_apply=%add", 8),
        ("replica_groups=mesh['d'=3] {'d'}, use_global_device_ids=true, dimensions={0}", 3),
        ("replica_groups=mesh['x'=8] {'x':(2)4}, dimensions={0}", 4),
        ("replica_groups=mesh[a=2,b=4], device_ids=([[0,2,1,3],[4,6,5,7]]) {b}, dimensions={0}", 4),
        ("replica_groups=mesh['a'=2] {}", 1),
    ],
)
def test_replica_group_forms(attrs, size):
    assert vt.parse_replica_group_size(attrs) == size


def test_unrecognised_replica_groups_raise():
    with pytest.raises(ValueError, match="replica_groups"):
        vt.parse_replica_group_size("replica_groups=something_new, dimensions={0}", 8)
    with pytest.raises(ValueError, match="mesh axis"):
        vt.parse_replica_group_size("replica_groups=mesh['a'=2] {'c'}", 8)


def test_empty_replica_groups_use_the_module_device_count():
    assert vt.parse_replica_group_size("replica_groups={}, dimensions={0}", 6) == 6
    assert vt.parse_replica_group_size("dimensions={0}") is None
    text = """HloModule m, replica_count=2, num_partitions=4
ENTRY %main (p: f32[8]) -> f32[64] {
  %p = f32[8]{0} parameter(0)
  ROOT %ag = f32[64]{0} all-gather(%p), replica_groups={}, dimensions={0}
}
"""
    assert _only(vt.census(text), "all-gather").group_size == 8
    with pytest.raises(ValueError, match="group size"):
        vt.census(text.replace("replica_count=2, num_partitions=4", ""))


# ---------------------------------------------------------------------------------------------------------------
# Replica-group forms, each parsed against the groups derived from the mesh it describes
# ---------------------------------------------------------------------------------------------------------------


def _axis_groups(shape, axes):
    """The groups of devices of a mesh ``{axis: size}`` (partition ids row-major over its axes) that differ only in
    ``axes``: one group per coordinate of the other axes, each listed row-major over ``axes`` as given."""
    names = list(shape)
    pid = {coords: i for i, coords in enumerate(itertools.product(*(range(shape[a]) for a in names)))}
    others = [a for a in names if a not in axes]
    groups = []
    for rest in itertools.product(*(range(shape[a]) for a in others)):
        group = []
        for sel in itertools.product(*(range(shape[a]) for a in axes)):
            where = dict(zip(others, rest, strict=True)) | dict(zip(axes, sel, strict=True))
            group.append(pid[tuple(where[a] for a in names)])
        groups.append(tuple(group))
    return tuple(groups)


def _listed(shape, order):
    """The partition ids of a mesh ``{axis: size}`` listed row-major over its axes taken in ``order``."""
    names = list(shape)
    pid = {coords: i for i, coords in enumerate(itertools.product(*(range(shape[a]) for a in names)))}
    listed = []
    for coords in itertools.product(*(range(shape[a]) for a in order)):
        where = dict(zip(order, coords, strict=True))
        listed.append(pid[tuple(where[a] for a in names)])
    return listed


def _braces(groups):
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


MESH_AB = {"a": 2, "b": 4}
MESH_XYZ = {"x": 2, "y": 2, "z": 2}


def _check_form(attrs, expected, num_devices=None):
    # Each group's order is the collective's device order; the order of the groups themselves carries no meaning.
    assert sorted(vt.parse_replica_groups(attrs, num_devices)) == sorted(expected)
    assert vt.parse_replica_group_size(attrs, num_devices) == len(expected[0])


@pytest.mark.parametrize("axes", [("a",), ("b",), ("b", "a")])
def test_replica_groups_explicit_form(axes):
    expected = _axis_groups(MESH_AB, axes)
    _check_form(f"channel_id=1, replica_groups={_braces(expected)}, dimensions={{0}}", expected)


def test_replica_groups_empty_form_is_one_group_of_every_device():
    _check_form("replica_groups={}, dimensions={0}", _axis_groups({"d": 8}, ("d",)), num_devices=8)
    _check_form("replica_groups={}, to_apply=%add", _axis_groups({"d": 3}, ("d",)), num_devices=3)
    assert vt.parse_replica_groups("replica_groups={}, dimensions={0}") is None


def test_replica_groups_iota_form():
    # [groups, group_size]<=[n]: consecutive ids, i.e. the inner axis of a groups x group_size mesh.
    _check_form("replica_groups=[2,4]<=[8], dimensions={0}", _axis_groups(MESH_AB, ("b",)))
    _check_form("replica_groups=[1,8]<=[8]", _axis_groups(MESH_AB, ("a", "b")))
    _check_form("replica_groups=[8,1]<=[8]", _axis_groups(MESH_AB, ()))


def test_replica_groups_transposed_iota_form():
    # The iota over the 2x4 mesh's (a, b) transposed to (b, a): groups over a.
    _check_form("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", _axis_groups(MESH_AB, ("a",)))
    # Over (x, y, z) transposed to (x, z, y): groups over y (printed by JAX 0.10 for a reshard on a 2-D mesh).
    _check_form("replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}", _axis_groups(MESH_XYZ, ("y",)))
    # Transposed to (y, z, x), grouping the last two: groups over (z, x) in that order.
    _check_form("replica_groups=[2,4]<=[2,2,2]T(1,2,0)", _axis_groups(MESH_XYZ, ("z", "x")))


@pytest.mark.parametrize("axes", [("a",), ("b",), ("a", "b"), ()])
def test_replica_groups_mesh_form(axes):
    named = ",".join(f"'{a}'" for a in axes)
    _check_form(
        f"replica_groups=mesh['a'=2,'b'=4] {{{named}}}, use_global_device_ids=true", _axis_groups(MESH_AB, axes)
    )
    unquoted = ",".join(axes)
    _check_form(f"replica_groups=mesh[a=2,b=4] {{{unquoted}}}, dimensions={{0}}", _axis_groups(MESH_AB, axes))


@pytest.mark.parametrize(("axis", "mesh_axis"), [("axis_0", "b"), ("axis_2", "a")])
def test_replica_groups_mesh_form_with_device_ids(axis, mesh_axis):
    # The partitioner's 4x1x2 mesh lists the devices of the 2x4 mesh (a, b) in (b, a) order: axis_0 is b, axis_2
    # is a. As JAX 0.10 prints it for a reshard from P('a', 'b') to P('b', None): the iota [2,4]T(1,0).
    expected = _axis_groups(MESH_AB, (mesh_axis,))
    mesh = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2]"
    _check_form(f"replica_groups={mesh}, device_ids=([2,4]T(1,0)) {{'{axis}'}}, metadata={{op_name=\"x\"}}", expected)
    listed = ",".join(map(str, _listed(MESH_AB, ("b", "a"))))
    _check_form(f"replica_groups={mesh}, device_ids=({listed}) {{'{axis}'}}, dimensions={{0}}", expected)


@pytest.mark.parametrize(
    ("axes", "mesh_axes"),
    [
        ("'axis_0':(2)2", ("z",)),
        ("'axis_0':(1)2", ("x",)),
        ("'axis_1'", ("y",)),
        ("'axis_1','axis_0':(2)2", ("y", "z")),
    ],
)
def test_replica_groups_mesh_form_with_sub_axes(axes, mesh_axes):
    # A 4x2 mesh listing the 2x2x2 mesh (x, y, z) in (x, z, y) order: axis_0 is (x, z), its sub-axis (1)2 is x and
    # (2)2 is z; axis_1 is y.
    attrs = f"replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {{{axes}}}, dimensions={{0}}"
    _check_form(attrs, _axis_groups(MESH_XYZ, mesh_axes))
    # Sub-axes of one axis (8 = p x q x r), named minor first.
    _check_form("replica_groups=mesh['x'=8] {'x':(4)2,'x':(1)2}", _axis_groups({"p": 2, "q": 2, "r": 2}, ("r", "p")))


def test_malformed_mesh_forms_raise_naming_the_form():
    with pytest.raises(ValueError, match="device_ids"):
        vt.parse_replica_groups("replica_groups=mesh['a'=2,'b'=4], device_ids=([2,2]T(1,0)) {'a'}")
    with pytest.raises(ValueError, match="overlap"):
        vt.parse_replica_groups("replica_groups=mesh['x'=8] {'x':(1)4,'x':(2)4}")
    with pytest.raises(ValueError, match="does not divide"):
        vt.parse_replica_groups("replica_groups=mesh['x'=8] {'x':(2)3}")


def _programs(mesh):
    """Programs compiled over the 2x4 mesh (a, b), each with the mesh axes (in group order) of its collectives."""
    x = jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32)
    w = jnp.ones((32, 8), jnp.float32)
    ab, b_ = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P("b", None))

    def smap(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")))).lower(x[0])

    def reshard(spec):
        return jax.jit(lambda v: v * 2, in_shardings=ab, out_shardings=NamedSharding(mesh, spec)).lower(x)

    return {
        "shard_map psum over a": (smap(lambda v: jax.lax.psum(v, "a")), [("a",)]),
        "shard_map all_gather over b": (smap(lambda v: jax.lax.all_gather(v, "b", tiled=True)), [("b",)]),
        "shard_map all_gather over (b, a)": (
            smap(lambda v: jax.lax.all_gather(v, ("b", "a"), tiled=True)),
            [("b", "a")],
        ),
        # Rows a -> gathered, then columns b traded for rows b.
        "jit P(a, b) -> P(b, None)": (reshard(P("b", None)), [("a",), ("b",)]),
        "jit P(a, b) -> P(None, None)": (reshard(P(None, None)), [("a",), ("b",)]),
        # The contraction over b sums partials over b, the total over rows sums over a.
        "jit sum(x @ w)": (jax.jit(lambda u, v: (u @ v).sum(), in_shardings=(ab, b_)).lower(x, w), [("a",), ("b",)]),
    }


def test_replica_groups_of_compiled_programs_match_the_mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    # Devices in a permuted order: replica-group ids are positions in mesh.devices.flat, not device ids.
    devices = np.array(jax.devices()[:8])[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    for name, (lowered, axes) in _programs(mesh).items():
        ops = [op for op in vt.census(lowered.compile()).ops if op.kind != "collective-permute"]
        parsed = sorted(tuple(sorted(op.replica_groups)) for op in ops)
        expected = sorted(tuple(sorted(_axis_groups(dict(mesh.shape), a))) for a in axes)
        assert parsed == expected, (name, [op.name for op in ops])
        assert [op.group_size for op in ops] == [len(g[0]) for g in (op.replica_groups for op in ops)], name


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[8,16]{1,0}", 4 * 8 * 16),
        ("bf16[3]", 6),
        ("pred[5]", 5),
        ("s4[3]", 2),
        ("f8e4m3fn[10]", 10),
        ("f32[]", 4),
        ("f32[<=12]", 48),
        ("(f32[2]{0}, /*index=1*/(bf16[4], s32[]), u32[])", 8 + 8 + 4 + 4),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert vt.shape_bytes(shape) == nbytes


def test_wire_bytes_formulas():
    b, g = 1200, 4
    assert vt.wire_bytes("all-gather", b, g) == b * (g - 1) / g
    assert vt.wire_bytes("reduce-scatter", b, g) == b * (g - 1)
    assert vt.wire_bytes("all-reduce", b, g) == 2 * b * (g - 1) / g
    assert vt.wire_bytes("all-to-all", b, g) == b * (g - 1) / g
    assert vt.wire_bytes("collective-permute", b, g) == b
    with pytest.raises(ValueError, match="unknown collective"):
        vt.wire_bytes("broadcast", b, g)


ASYNC_AND_TUPLES = """HloModule async, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[16], p1: bf16[32]) -> f32[128] {
  %p0 = f32[16]{0} parameter(0)
  %p1 = bf16[32]{0} parameter(1)
  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(%p0), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[128]{0} all-gather-done(%ags)
  %ar = (f32[16]{0}, bf16[32]{0}) all-reduce(%p0, %p1), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %ars = f32[16]{0} all-reduce-start(%p0), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %rss = ((f32[16]{0}), f32[2]{0}) reduce-scatter-start(%p0), channel_id=4, \
replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %rsd = f32[2]{0} reduce-scatter-done(%rss)
  %cps = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%p0), channel_id=5, \
source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %agm = ((f32[16]{0}, bf16[32]{0}), (f32[128]{0}, /*index=1*/bf16[256]{0})) all-gather-start(%p0, %p1), \
channel_id=6, replica_groups=[1,8]<=[8], dimensions={0}
  %agmd = (f32[128]{0}, bf16[256]{0}) all-gather-done(%agm)
  ROOT %r = f32[128]{0} add(%agd, %agd)
}
"""


def test_async_pairs_count_once_and_take_the_output_part():
    c = vt.census(ASYNC_AND_TUPLES)
    ags = c.of("all-gather")
    assert [op.result_bytes for op in ags] == [4 * 128, 4 * 128 + 2 * 256]
    assert all(op.is_async and op.group_size == 8 for op in ags)
    assert c.count("all-gather") == 2
    assert c.wire_bytes("all-gather") == (4 * 128 + 4 * 128 + 2 * 256) * 7 / 8
    ar, ars = c.of("all-reduce")
    assert (ar.result_bytes, ar.group_size, ar.is_async) == (4 * 16 + 2 * 32, 4, False)
    assert ar.shape == "(f32[16], bf16[32])"
    assert (ars.result_bytes, ars.group_size, ars.is_async) == (4 * 16, 2, True)
    rs = _only(c, "reduce-scatter")
    assert (rs.result_bytes, rs.group_size) == (4 * 2, 8)
    cp = _only(c, "collective-permute")
    assert (cp.result_bytes, cp.group_size, cp.wire_bytes) == (4 * 16, 2, 4 * 16)
    assert c.largest("all-gather") is ags[1]


def _while(name, body, cond, trip):
    config = "" if trip is None else f', backend_config={{"known_trip_count":{{"n":"{trip}"}}}}'
    return f"  %{name} = (s32[], f32[8]{{0}}) while(%t), condition=%{cond}, body=%{body}{config}\n"


def _loop_module(outer_trip, inner_trip):
    return (
        """HloModule loops, num_partitions=4

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%fused (a: f32[32]) -> f32[8] {
  %a = f32[32]{0} parameter(0)
  ROOT %sl = f32[8]{0} slice(%a), slice={[0:8]}
}

%inner_body (ib: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ib = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%ib), index=0
  %v = f32[8]{0} get-tuple-element(%ib), index=1
  %g = f32[32]{0} all-gather(%v), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %f = f32[8]{0} fusion(%g), kind=kLoop, calls=%fused
  ROOT %o = (s32[], f32[8]{0}) tuple(%i, %f)
}

%helper (h: f32[8]) -> f32[8] {
  %h = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%h), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
}

%branch_a (ba: f32[8]) -> f32[8] {
  %ba = f32[8]{0} parameter(0)
  ROOT %ra = f32[2]{0} reduce-scatter(%ba), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%cond
}

%branch_b (bb: f32[8]) -> f32[8] {
  %bb = f32[8]{0} parameter(0)
  ROOT %nb = f32[8]{0} negate(%bb)
}

%outer_body (ob: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
"""
        + _while("inner", "inner_body", "cond", inner_trip)
        + """  %j = s32[] get-tuple-element(%inner), index=0
  %w = f32[8]{0} get-tuple-element(%inner), index=1
  %x = f32[8]{0} call(%w), to_apply=%helper
  %y = f32[8]{0} conditional(%j, %x, %x), branch_computations={%branch_a, %branch_b}
  ROOT %ot = (s32[], f32[8]{0}) tuple(%j, %y)
}

%unused (u: f32[8]) -> f32[32] {
  %u = f32[8]{0} parameter(0)
  ROOT %ug = f32[32]{0} all-gather(%u), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(%z, %p)
"""
        + _while("outer", "outer_body", "cond", outer_trip)
        + """  %e = f32[8]{0} all-reduce(%p), channel_id=4, replica_groups={}, to_apply=%cond
  ROOT %res = f32[8]{0} get-tuple-element(%outer), index=1
}
"""
    )


def test_nested_while_call_fusion_and_conditional_multipliers():
    outer, inner = 3, 4
    c = vt.census(_loop_module(outer, inner))
    assert [op.name for op in c.ops] == ["g", "cp", "ra", "e"]  # %unused is not reachable from ENTRY
    g, cp, ra, e = c.ops
    assert (g.multiplier, g.in_loop, g.computation) == (outer * inner, True, "inner_body")
    assert (cp.multiplier, cp.in_loop, cp.group_size) == (outer, True, 4)  # through call
    assert (ra.multiplier, ra.in_loop) == (outer, True)  # conditional branch: an upper bound
    assert (e.multiplier, e.in_loop, e.group_size) == (1, False, 4)  # empty groups: num_partitions
    assert c.count("all-gather") == outer * inner
    assert c.bytes("all-gather") == outer * inner * 4 * 32
    assert c.wire_bytes("all-gather") == outer * inner * 4 * 32 * 3 / 4
    assert c.wire_bytes("reduce-scatter") == outer * 4 * 2 * 3
    assert c.unknown_trip_counts == ()


def test_unknown_inner_trip_count_counts_once_and_flags():
    c = vt.census(_loop_module(3, None))
    g = _only(c, "all-gather")
    assert (g.multiplier, g.unknown_trip_count) == (3, True)
    assert not _only(c, "collective-permute").unknown_trip_count
    assert c.unknown_trip_counts == ("inner",)


def test_snippet_without_entry_treats_uncalled_computations_as_roots():
    text = """%body (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%b), replica_groups={{0,1}}, to_apply=%sum
}

%top (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %w = f32[4]{0} while(%p), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"7"}}
}
"""
    op = _only(vt.census(text), "all-reduce")
    assert (op.multiplier, op.in_loop, op.group_size) == (7, True, 2)


def test_raw_async_start_wrapping_a_collective_counts_once():
    text = """HloModule raw, num_partitions=4

%wrapped (a: f32[16]) -> f32[4] {
  %a = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%a), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%sum
}

ENTRY %main (p: f32[16]) -> f32[4] {
  %p = f32[16]{0} parameter(0)
  %st = ((f32[16]{0}), f32[4]{0}, s32[]) async-start(%p), calls=%wrapped
  ROOT %dn = f32[4]{0} async-done(%st), calls=%wrapped
}
"""
    op = _only(vt.census(text), "reduce-scatter")
    assert (op.multiplier, op.result_bytes, op.wire_bytes) == (1, 16, 16 * 3)


def test_census_rejects_unknown_kind():
    c = vt.census(ASYNC_AND_TUPLES)
    with pytest.raises(ValueError, match="unknown collective kind"):
        c.count("all-gathers")
    assert set(c.summary()) == set(vt.KINDS)
