"""Lowering for CUDA on a CPU machine: the ``vj.fsdp`` step with the Pallas kernels *compiled* (not interpreted).

Every case traces the example GPT's step (``examples/gpt.py``, a small config) on 8 simulated CPU devices and
lowers it for ``cuda`` only (``jax.export`` under an outer ``jax.jit``, or ``step.lower(...,
lowering_platforms=("cuda",))``); nothing is compiled or executed. The lowered module is read for:

- the kernels' custom calls: ``__gpu$xla.gpu.triton`` (Triton) or ``mosaic_gpu_v2`` (Mosaic GPU), and none of
  the interpreter's code (the ``cpu`` branch of the kernels' ``platform_dependent`` is pruned);
- the collectives: the same all-gathers and reduce-scatters (count, shape, dtype) as the XLA-packed step
  lowered for CPU, and at least one all-gather of every bucket's gathered size (the plan's buckets);
- the wire dtypes: bf16 all-gathers with ``MixedPrecision(compute_dtype=bf16)``, ui8 codes with ``fp8_gather``;
- no host callback (``xla_python_cpu_callback`` / ``xla_ffi_python_cpu_callback`` / ``host_callback``).

Cases, per backend (``KernelPolicy(mode="pallas", interpret=False, backend=...)``, an explicit request):

- ``triton``: fp32; ``MixedPrecision(compute_dtype=bf16)``; ``fp8_gather``; ``vj.scan_layers`` with prefetch;
  ``vj.accumulate``; HSDP 2x4; FSDP x tensor 2x4; Muon, Shampoo and ``adamw_8bit`` updates.
- ``mosaic_gpu``: fp32 and HSDP 2x4 with a plan of ``align_bytes=128`` (every leaf and padding gap a multiple
  of 128 bytes).
- The checkpoint's logical conversion (``relayout``: all-to-alls, no kernel) lowers for CUDA as it is.

What cannot lower, and is refused with a ``ValueError`` naming the bucket (``KernelPolicy.implementation``):

- ``mosaic_gpu`` with a cast or a scale (the gradient pack under ``MixedPrecision(compute_dtype=bf16)``, FP8):
  its TMA copies move bytes unchanged;
- ``mosaic_gpu`` on a bucket whose leaves or padding gaps are under 128 bytes or not 16-byte aligned (each TMA
  transfer moves a multiple of a warpgroup's 128 bytes): plan with ``align_bytes=128``;
- any compiled kernel lowered for ``cpu`` (Pallas compiles for GPU only);
- a multi-platform export (``platforms=["cuda", "cpu"]``) of a step with compiled kernels: Pallas lowers its
  compiled call for every platform of the module, and its CPU rule raises ("Only interpret mode is supported
  on CPU backend"), even inside the ``cuda`` branch of ``platform_dependent``; export one platform at a time.

``KernelPolicy(mode="pallas")`` (``interpret=None``) is not refused: on CPU devices it lowers the interpreter for
``cpu`` and the compiled kernels for ``cuda``, falling back per bucket (``mosaic_gpu`` -> ``triton``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import load_script

import vescale_jax as vj
from vescale_jax._compat import mosaic_gpu_pallas_call
from vescale_jax.kernels import KernelPolicy

gpt = load_script("examples/gpt.py")

CFG = gpt.GPTConfig(vocab=128, max_len=16, d_model=64, num_heads=2, num_layers=2, d_ff=128)
TRITON = KernelPolicy(mode="pallas", interpret=False, backend="triton")
MOSAIC = KernelPolicy(mode="pallas", interpret=False, backend="mosaic_gpu")
XLA = KernelPolicy(mode="xla")
TRITON_CALL = "@__gpu$xla.gpu.triton"
MOSAIC_CALL = "mosaic_gpu"
MOSAIC_LOWERS = mosaic_gpu_pallas_call()  # False from JAX 0.11: Mosaic GPU kernels run through plgpu.kernel only
NO_MOSAIC = r"bucket '[^']+'.*no pallas_call lowering for Mosaic GPU"
CALLBACKS = ("xla_python_cpu_callback", "xla_ffi_python_cpu_callback", "host_callback")
DISABLED = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
_COLLECTIVE = re.compile(
    r'"stablehlo\.(all_gather|reduce_scatter|all_to_all)"\(.*?->\s*tensor<((?:\d+x)*)([a-z][a-z0-9]*)>', re.DOTALL
)


@pytest.fixture(autouse=True)
def _standard_promotion_and_gpu_target():
    # optax's Adam bias correction mixes float and int32; Triton kernels lower for an H100-class GPU (JAX >= 0.11
    # needs the target named where the process has no GPU)
    with jax.numpy_dtype_promotion("standard"), vj.kernels.gpu_lowering_target():
        yield


def census(text: str) -> list[tuple[str, str, str]]:
    """Sorted ``(op, shape, element type)`` of every all-gather, reduce-scatter and all-to-all in a module."""
    return sorted(m.groups() for m in _COLLECTIVE.finditer(text))


def mesh_1d() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])


def gpt_plan(mesh=None, **kw) -> vj.Plan:
    _, shapes = gpt.abstract_model(CFG)
    kw.setdefault("granularity", vj.rows(1))
    return vj.plan(shapes, mesh or mesh_1d(), stacked=("blocks",), **kw)


def gpt_step(plan, tx, *, kernels, microbatches=None, **options):
    """The example's train step (``examples/train_gpt.py``) on ``plan``, its params, state and a batch."""
    graphdef, _ = gpt.abstract_model(CFG)
    params = vj.init_sharded(lambda key: gpt.init_params(CFG, key), plan, jax.random.key(0))
    opt_state = vj.init_opt_state(tx, params)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, CFG.vocab, (16, CFG.max_len)).astype(np.int32) for k in ("x", "y")}

    @vj.fsdp(kernels=kernels, microbatches=microbatches, **options)
    def step(params, opt_state, batch):
        def loss_of(p, b):
            return gpt.loss_fn(vj.flax.nnx_apply(graphdef, p, b["x"]), b["y"])

        if microbatches:
            loss, grads = vj.accumulate(loss_of, params, batch)
        else:
            loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, batch)


def export_cuda(step, args) -> str:
    """The step under an outer ``jax.jit``, exported for CUDA only: the module's text."""
    exported = jax.export.export(jax.jit(lambda p, o, b: step(p, o, b)), platforms=["cuda"], disabled_checks=DISABLED)(
        *args
    )
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


def check_module(
    text: str, plan: vj.Plan, *, call: str, reference: str, wire: str = "f32", every_bucket: bool = True
) -> None:
    """The kernels' custom calls, the reference's collectives, every bucket gathered at its full size (unless
    the wire packs codes and scales otherwise: FP8), the wire dtype, no host callback."""
    assert call in text, f"no {call} custom call: the kernels did not reach the CUDA lowering"
    for name in CALLBACKS:
        assert name not in text, f"a host callback ({name}) in the CUDA lowering"
    got, want = census(text), census(reference)
    assert got == want, "the kernels changed the collectives"
    gathers = [c for c in got if c[0] == "all_gather"]
    scatters = [c for c in got if c[0] == "reduce_scatter"]
    assert gathers and scatters
    sizes = {int(np.prod([int(d) for d in s.split("x") if d])) for _, s, _ in gathers}
    for bucket in plan.buckets if every_bucket else ():
        full = bucket.layout.total_size
        assert full in sizes or any(full * k in sizes for k in (1, 2)), f"bucket {bucket.name!r} never gathered"
    assert {t for _, _, t in gathers} <= {wire, "f32", "i32", "ui32"} and any(t == wire for _, _, t in gathers)


def reference_text(plan, tx, **options) -> str:
    """The same step with XLA's pack and unpack, lowered for the CPU devices."""
    step, args = gpt_step(plan, tx, kernels=XLA, **options)
    return step.lower(*args).as_text()


ADAMW = optax.adamw(1e-3)


def tiny_step(kernels, microbatches=None):
    """A one-layer model's step (two buckets), its params, state and batch: quick to trace."""
    logical = {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 2048, "b": jnp.ones((32,))}
    params = vj.shard(logical, vj.plan(logical, mesh_1d()))
    tx = optax.sgd(0.1)
    opt_state = vj.init_opt_state(tx, params)
    x = jnp.linspace(-1.0, 1.0, 16 * 64, dtype=jnp.float32).reshape(16, 64)

    def loss(p, x):
        return jnp.mean(vj.apply(lambda t, x: jnp.sum((x @ t["w"] + t["b"]) ** 2, axis=-1), p, x))

    @vj.fsdp(kernels=kernels, microbatches=microbatches)
    def step(params, opt_state, x):
        if microbatches:
            value, grads = vj.accumulate(loss, params, x)
        else:
            value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, opt_state, x)


# --------------------------------------------------------------------------------------------------------------
# Quick cases (fast tier)


def test_triton_step_composes_under_jit_and_exports_for_cuda():
    plan = gpt_plan()
    step, args = gpt_step(plan, ADAMW, kernels=TRITON)
    text = export_cuda(step, args)
    check_module(text, plan, call=TRITON_CALL, reference=reference_text(plan, ADAMW))
    assert MOSAIC_CALL not in text
    # The step's own lowering for CUDA holds the same kernels and collectives.
    lowered = step.lower(*args, lowering_platforms=("cuda",)).as_text()
    assert lowered.count(TRITON_CALL) == text.count(TRITON_CALL) > 0
    assert census(lowered) == census(text)


def test_kernels_follow_the_lowering_platform():
    """``KernelPolicy(mode="pallas")`` on CPU devices: compiled Triton for CUDA, the interpreter for CPU."""
    step, args = tiny_step(KernelPolicy(mode="pallas"))
    cuda = step.lower(*args, lowering_platforms=("cuda",)).as_text()
    cpu = step.lower(*args).as_text()
    assert TRITON_CALL in cuda
    assert TRITON_CALL not in cpu and "custom_call" not in cpu
    assert census(cuda) == census(cpu) and census(cpu)


def test_explicit_compiled_kernels_are_refused_for_cpu():
    step, args = tiny_step(TRITON)
    with pytest.raises(ValueError, match=r"lower for GPU only.*'cpu'"):
        step(*args)
    with pytest.raises(ValueError, match="lowering_platforms"):
        step.lower(*args, lowering_platforms=("cpu",))
    assert TRITON_CALL in step.lower(*args, lowering_platforms=("cuda",)).as_text()


def test_mosaic_refuses_what_it_cannot_copy():
    """An explicit mosaic_gpu request raises, naming the reason, where ``mode="pallas"`` falls back."""
    layout = vj.plan_bucket([64, 8], [1, 1], 8, align=4)  # a 32-byte leaf: under a warpgroup's 128 bytes
    with pytest.raises(ValueError, match="warpgroup" if MOSAIC_LOWERS else NO_MOSAIC):
        MOSAIC.implementation(layout, np.float32, np.float32, platform="cuda", name="b")
    with pytest.raises(ValueError, match=r"bucket 'b'.*cast" if MOSAIC_LOWERS else NO_MOSAIC):
        aligned = vj.plan_bucket([64, 128], [1, 1], 8, align=32)
        MOSAIC.implementation(aligned, np.dtype(jnp.bfloat16), np.float32, platform="cuda", name="b")
    lenient = KernelPolicy(mode="pallas", backend="mosaic_gpu")
    assert lenient.implementation(layout, np.float32, np.float32, platform="cuda") == "triton"
    # a bucket Mosaic GPU copies, with too narrow a window; a JAX without Mosaic GPU's pallas_call refuses first
    with pytest.raises(
        ValueError if MOSAIC_LOWERS else NotImplementedError,
        match="chunk=16" if MOSAIC_LOWERS else "no pallas_call lowering for Mosaic GPU",
    ):
        vj.kernels.pack([jnp.zeros(64)], vj.plan_bucket([64], [1], 1), interpret=False, backend="mosaic_gpu", chunk=16)


@pytest.mark.parametrize("microbatches", [None, 2], ids=["step", "accumulate"])
def test_step_runs_under_an_outer_jit_and_from_an_export(microbatches):
    """The step nests in jax.jit and exports from abstract arguments; both run (interpreted kernels on CPU)
    and give the step's own results, and the outer jit donates nothing."""
    step, (params, opt_state, x) = tiny_step(KernelPolicy(mode="pallas"), microbatches)
    outer = jax.jit(lambda p, o, b: step(p, o, b))
    nested = outer(params, opt_state, x)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (params, opt_state))
    exported = jax.export.export(outer, platforms=["cpu"])(*specs, jax.ShapeDtypeStruct(x.shape, x.dtype))
    called = exported.call(params, opt_state, x)
    assert not any(b.is_deleted() for b in params.buffers)
    direct = step(params, opt_state, x)
    for got in (nested, called):
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(direct[2]))
        for g, w in zip(got[0].buffers, direct[0].buffers, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --------------------------------------------------------------------------------------------------------------
# Every feature, lowered for CUDA (the default matrix)


def test_mosaic_step_exports_for_cuda():
    plan = gpt_plan(align_bytes=128)
    step, args = gpt_step(plan, ADAMW, kernels=MOSAIC)
    if not MOSAIC_LOWERS:  # the explicit request is refused, naming the bucket and why; mode="pallas" falls back
        with pytest.raises(ValueError, match=NO_MOSAIC):
            export_cuda(step, args)
        step, args = gpt_step(plan, ADAMW, kernels=KernelPolicy(mode="pallas", backend="mosaic_gpu"))
        check_module(export_cuda(step, args), plan, call=TRITON_CALL, reference=reference_text(plan, ADAMW))
        return
    text = export_cuda(step, args)
    check_module(text, plan, call=MOSAIC_CALL, reference=reference_text(plan, ADAMW))
    assert TRITON_CALL not in text


def test_mosaic_mixed_precision():
    """bf16 gathers and bf16 gradient reductions are plain copies: Mosaic GPU lowers them; reducing in fp32
    fuses a cast into the gradient pack, which Mosaic GPU cannot do: refused, naming the bucket."""
    plan = gpt_plan(align_bytes=128)
    bf16 = vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16)
    step, args = gpt_step(plan, ADAMW, kernels=MOSAIC, precision=bf16)
    if not MOSAIC_LOWERS:
        with pytest.raises(ValueError, match=NO_MOSAIC):
            export_cuda(step, args)
        return
    ref = reference_text(plan, ADAMW, precision=bf16)
    check_module(export_cuda(step, args), plan, call=MOSAIC_CALL, reference=ref, wire="bf16")
    fp32_reduce = vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    step, args = gpt_step(plan, ADAMW, kernels=MOSAIC, precision=fp32_reduce)
    with pytest.raises(ValueError, match=r"bucket '[^']+'.*bfloat16 -> float32.*mosaic_gpu.*cast"):
        export_cuda(step, args)


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_mixed_precision_bf16(prefetch):
    plan = gpt_plan()
    bf16 = vj.MixedPrecision(compute_dtype=jnp.bfloat16)
    step, args = gpt_step(plan, ADAMW, kernels=TRITON, precision=bf16, prefetch=prefetch)
    ref = reference_text(plan, ADAMW, precision=bf16, prefetch=prefetch)
    check_module(export_cuda(step, args), plan, call=TRITON_CALL, reference=ref, wire="bf16")


def test_fp8_gather():
    plan = gpt_plan(granularity=lambda path, leaf: vj.tiles(32, 32) if leaf.ndim >= 2 else vj.rows(1))
    fp8 = vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32, fp8_gather=(32, 32))
    step, args = gpt_step(plan, ADAMW, kernels=TRITON, precision=fp8)
    ref = reference_text(plan, ADAMW, precision=fp8)
    text = export_cuda(step, args)
    check_module(text, plan, call=TRITON_CALL, reference=ref, wire="ui8", every_bucket=False)
    matrices = [b for b in plan.buckets if any(plan.leaves[i].shape[-2:] == (64, 64) for i in b.leaves)]
    assert matrices and len([c for c in census(text) if c[0] == "all_gather" and c[2] == "ui8"]) >= len(matrices)
    # KernelPolicy(mode="pallas") on these CPU devices: the fused FP8 kernels compiled for CUDA too.
    step, args = gpt_step(plan, ADAMW, kernels=KernelPolicy(mode="pallas"), precision=fp8)
    cuda = step.lower(*args, lowering_platforms=("cuda",)).as_text()
    assert cuda.count(TRITON_CALL) >= text.count(TRITON_CALL) > 0


def test_scan_layers_with_prefetch():
    plan = gpt_plan()
    step, args = gpt_step(plan, ADAMW, kernels=TRITON, prefetch=True)
    text = export_cuda(step, args)
    check_module(text, plan, call=TRITON_CALL, reference=reference_text(plan, ADAMW, prefetch=True))
    assert "stablehlo.while" in text  # the layer scan stays a loop


def test_accumulate():
    plan = gpt_plan()
    step, args = gpt_step(plan, ADAMW, kernels=TRITON, microbatches=2)
    check_module(export_cuda(step, args), plan, call=TRITON_CALL, reference=reference_text(plan, ADAMW, microbatches=2))


def hsdp_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])


@pytest.mark.parametrize("kernels", [TRITON, MOSAIC], ids=["triton", "mosaic_gpu"])
def test_hsdp_2x4(kernels):
    plan = gpt_plan(hsdp_mesh(), align_bytes=128)
    options = dict(data_axes=("replica", "fsdp"))
    step, args = gpt_step(plan, ADAMW, kernels=kernels, **options)
    if kernels is MOSAIC and not MOSAIC_LOWERS:
        with pytest.raises(ValueError, match=NO_MOSAIC):
            export_cuda(step, args)
        return
    text = export_cuda(step, args)
    call = TRITON_CALL if kernels is TRITON else MOSAIC_CALL
    check_module(text, plan, call=call, reference=reference_text(plan, ADAMW, **options))
    assert "stablehlo.all_reduce" in text  # the replica sums


def test_fsdp_by_tensor_2x4():
    gpt_tp = load_script("examples/gpt_tp.py")
    cfg = gpt_tp.Config(vocab=256, max_len=16, d_model=32, num_heads=4, num_layers=2, d_ff=64, tensor="tensor")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    graphdef, shapes = gpt_tp.abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), tp=gpt_tp.partition_spec(cfg))
    tx = ADAMW

    def build(kernels):
        params = vj.shard(gpt_tp.split_model(cfg, jax.random.key(0))[1], plan)
        opt_state = vj.init_opt_state(tx, params)
        x = np.random.default_rng(0).integers(0, cfg.vocab, (8, cfg.max_len)).astype(np.int32)

        @vj.fsdp(kernels=kernels)
        def step(params, opt_state, batch):
            def loss_of(p, x):
                logits = vj.flax.nnx_apply(graphdef, p, x[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_of)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step, (params, opt_state, x)

    step, args = build(XLA)
    reference = step.lower(*args).as_text()
    step, args = build(TRITON)
    check_module(export_cuda(step, args), plan, call=TRITON_CALL, reference=reference)


def _muon(plan):
    _, shapes = gpt.abstract_model(CFG)
    return vj.optim.muon(
        1e-3, plan=plan, adam_learning_rate=1e-3, muon_weight_dimension_numbers=gpt.muon_dimension_numbers(shapes)
    )


def _shampoo_plan():
    def matrix(path, leaf):
        return leaf.ndim - (vj.default_unit(path, leaf) == "blocks") >= 2

    return gpt_plan(granularity=lambda path, leaf: vj.rows(32 if matrix(path, leaf) else 1))


OPTIMIZERS = {
    "muon": (gpt_plan, _muon),
    "shampoo": (_shampoo_plan, lambda plan: vj.optim.shampoo(1e-3, plan=plan, block_size=32)),
    "adamw_8bit": (
        lambda: gpt_plan(granularity=lambda path, leaf: vj.tiles(32, 32) if leaf.ndim >= 2 else vj.rows(1)),
        lambda plan: vj.optim.adamw_8bit(1e-3, plan=plan),
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers(name):
    make_plan, make_tx = OPTIMIZERS[name]
    plan = make_plan()
    tx = make_tx(plan)
    step, args = gpt_step(plan, tx, kernels=TRITON)
    check_module(export_cuda(step, args), plan, call=TRITON_CALL, reference=reference_text(plan, tx))


def test_checkpoint_logical_conversion():
    """The checkpoint's conversion to and from the logical leaves (all-to-alls, no kernel) lowers for CUDA."""
    from vescale_jax.relayout import _logical_leaves as logical

    plan = gpt_plan()
    fn, shardings = logical._to_logical_fn(plan)
    args = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s) for b, s in zip(plan.buckets, shardings, strict=True)]
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert any(op == "all_to_all" for op, _, _ in census(text))
    assert not any(name in text for name in CALLBACKS)
    dtypes = tuple(b.dtype for b in plan.buckets)
    back, shardings = logical._from_logical_fn(plan, tuple(np.dtype(d).name for d in dtypes))
    leaves = [
        jax.ShapeDtypeStruct(leaf.shape, plan.buckets[leaf.bucket].dtype, sharding=s)
        for leaf, s in zip(plan.leaves, shardings, strict=True)
    ]
    text = back.trace(*leaves).lower(lowering_platforms=("cuda",)).as_text()
    assert any(op == "all_to_all" for op, _, _ in census(text))
    assert not any(name in text for name in CALLBACKS)
