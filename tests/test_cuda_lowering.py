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
- ``mosaic_gpu`` (``plgpu.kernel``, the default on JAX 0.11 and later): fp32; bf16 gathers with fp32 and bf16
  gradient reductions (the casts fused); ``fp8_gather`` (pack and unpack on Mosaic GPU, the fused FP8 quantize /
  dequantize on Triton: ``KernelPolicy.fused_implementation``); a bucket of leaves under 128 bytes at offsets that
  are not 16-byte aligned; HSDP 2x4.
- The checkpoint's logical conversion (``relayout``: all-to-alls, no kernel) lowers for CUDA as it is.

What cannot lower, and is refused with a ``ValueError``:

- any compiled kernel lowered for ``cpu`` (Pallas compiles for GPU only);
- a multi-platform export (``platforms=["cuda", "cpu"]``) of a step with compiled kernels: Pallas lowers its
  compiled call for every platform of the module, and its CPU rule raises ("Only interpret mode is supported
  on CPU backend"), even inside the ``cuda`` branch of ``platform_dependent``; export one platform at a time.

``KernelPolicy(mode="pallas")`` (``interpret=None``) is not refused: on CPU devices it lowers the interpreter for
``cpu`` and the compiled kernels of this JAX's default backend (:func:`vescale_jax.kernels.default_gpu_backend`)
for ``cuda``.
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
from vescale_jax.kernels import KernelPolicy

gpt = load_script("examples/gpt.py")

CFG = gpt.GPTConfig(vocab=128, max_len=16, d_model=64, num_heads=2, num_layers=2, d_ff=128)
TRITON = KernelPolicy(mode="pallas", interpret=False, backend="triton")
MOSAIC = KernelPolicy(mode="pallas", interpret=False, backend="mosaic_gpu")
XLA = KernelPolicy(mode="xla")
F32 = np.dtype(np.float32)
TRITON_CALL = "@__gpu$xla.gpu.triton"
MOSAIC_CALL = "@mosaic_gpu"
DEFAULT_CALL = MOSAIC_CALL if vj.kernels.default_gpu_backend() == "mosaic_gpu" else TRITON_CALL
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


def tiny_step(kernels, microbatches=None, bias=32, **plan_options):
    """A one-layer model's step (two buckets), its params, state and batch: quick to trace."""
    logical = {"w": jnp.arange(64 * bias, dtype=jnp.float32).reshape(64, bias) / 2048, "b": jnp.ones((bias,))}
    params = vj.shard(logical, vj.plan(logical, mesh_1d(), **plan_options))
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


_OP = re.compile(
    r'(?:"stablehlo\.(all_gather|reduce_scatter)"\(|stablehlo\.custom_call @(__gpu\$xla\.gpu\.triton|mosaic_gpu\w*))'
)


def op_counts(text: str) -> dict[str, int]:
    """How many kernel custom calls, all-gathers and reduce-scatters a module holds, counted as *operations*.

    A count of the names in the text is not one: ``jax.export``'s module keeps debug locations
    (``loc("all_gather"(...))``) that ``Lowered.as_text()`` leaves out, and a Triton call names its target again
    in its backend config."""
    counts: dict[str, int] = {}
    for collective, kernel in _OP.findall(text):
        key = collective or ("triton" if "triton" in kernel else "mosaic_gpu")
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize(
    "option", ["fp32", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("keep", marks=pytest.mark.slow)]
)
def test_kernel_and_collective_counts_agree_between_lowerings_and_backends(option):
    """The example's step (``clip_by_global_norm`` + AdamW, the grad norm returned): ``step.lower`` for CUDA and
    ``jax.export`` give the same kernel calls and collectives, and Triton, Mosaic GPU and XLA's pack the same
    collectives (the kernels move bytes only; the XLA policy's module has no kernel call)."""
    plan = gpt_plan()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b2=0.99, weight_decay=0.1))
    options = {
        "fp32": {},
        "bf16": {"precision": vj.MixedPrecision(compute_dtype="bfloat16", reduce_dtype="float32")},
        "keep": {"reshard_after_forward": False},
    }[option]
    counts = {}
    for name, kernels in (("xla", XLA), ("triton", TRITON), ("mosaic_gpu", MOSAIC)):
        step, args = gpt_step(plan, tx, kernels=kernels, **options)
        lowered = op_counts(step.lower(*args, lowering_platforms=("cuda",)).as_text())
        exported = op_counts(export_cuda(step, args))
        assert lowered == exported, f"{name}: step.lower {lowered} != jax.export {exported}"
        counts[name] = lowered
    collectives = counts["xla"]
    assert collectives["all_gather"] > 0 and collectives["reduce_scatter"] > 0
    for name in ("triton", "mosaic_gpu"):
        assert counts[name].pop(name) > 0, f"no {name} kernel call"
        assert counts[name] == collectives, f"{name}'s collectives {counts[name]} differ from XLA's {collectives}"


def test_kernels_follow_the_lowering_platform():
    """``KernelPolicy(mode="pallas")`` on CPU devices: compiled Triton for CUDA, the interpreter for CPU."""
    step, args = tiny_step(KernelPolicy(mode="pallas"))
    cuda = step.lower(*args, lowering_platforms=("cuda",)).as_text()
    cpu = step.lower(*args).as_text()
    assert DEFAULT_CALL in cuda
    assert TRITON_CALL not in cpu and MOSAIC_CALL not in cpu and "custom_call" not in cpu
    assert census(cuda) == census(cpu) and census(cpu)


def test_explicit_compiled_kernels_are_refused_for_cpu():
    step, args = tiny_step(TRITON)
    with pytest.raises(ValueError, match=r"lower for GPU only.*'cpu'"):
        step(*args)
    with pytest.raises(ValueError, match="lowering_platforms"):
        step.lower(*args, lowering_platforms=("cpu",))
    assert TRITON_CALL in step.lower(*args, lowering_platforms=("cuda",)).as_text()


def test_mosaic_takes_every_bucket():
    """Mosaic GPU takes casts, scales, small and unaligned leaves: an explicit request is honoured for each; a
    window narrower than a warpgroup is refused, naming the chunk."""
    small = vj.plan_bucket([64, 7, 3], [1, 1, 1], 8, align=1)  # 28- and 12-byte leaves at unaligned offsets
    for src, dst in [(np.float32, np.float32), (np.float32, jnp.bfloat16), (jnp.bfloat16, np.float32)]:
        assert MOSAIC.implementation(small, np.dtype(src), np.dtype(dst), platform="cuda", name="b") == "mosaic_gpu"
    assert KernelPolicy(mode="pallas", backend="mosaic_gpu").implementation(small, F32, F32, platform="cuda") == (
        "mosaic_gpu"
    )
    with pytest.raises(ValueError, match="chunk=16"):
        vj.kernels.pack([jnp.zeros(64)], vj.plan_bucket([64], [1], 1), interpret=False, backend="mosaic_gpu", chunk=16)


def test_mosaic_small_unaligned_leaves_lower_for_cuda():
    """A bucket of a 64x32 matrix and a 5-element bias (20 bytes, off any 16-byte boundary on 8 devices):
    the whole step's packs and unpacks are Mosaic GPU kernels, no Triton."""
    step, args = tiny_step(MOSAIC, bias=5, granularity=vj.rows(1))
    text = step.lower(*args, lowering_platforms=("cuda",)).as_text()
    assert MOSAIC_CALL in text and TRITON_CALL not in text
    reference = tiny_step(XLA, bias=5, granularity=vj.rows(1))
    assert census(text) == census(reference[0].lower(*reference[1]).as_text())


@pytest.mark.parametrize(
    ("width", "tiles"),
    [(16, False), (48, False), (48, True)],
    ids=["blocks-of-whole-rows", "blocks-cut-rows", "tiles-are-blocks"],
)
def test_mosaic_fp8_gather_lowers_for_cuda(width, tiles):
    """The FP8 block-scaled gather (16x16 blocks) of a matrix, plus an exact bias, under a Mosaic GPU policy:
    where each block is one contiguous run (16 whole rows of a row-major matrix planned in bands of 16 rows; a
    16x16 tile of a matrix stored in such tiles) quantize, dequantize and the tile relayout of the gradient's pack
    are Mosaic GPU kernels and the step holds no Triton call; where a block is 16 pieces of rows the FP8 kernels
    take Triton (per-lane gathers), as KernelPolicy.fused_implementation says."""
    logical = {"a": {"w": jnp.arange(48 * width, dtype=jnp.float32).reshape(48, width) / 2048, "b": jnp.ones((5,))}}
    matrix = vj.tiles(16, 16) if tiles else vj.rows(16)
    gran = lambda path, leaf: matrix if leaf.ndim >= 2 else vj.element()
    plan = vj.plan(logical, mesh_1d(), granularity=gran, split="none")
    params = vj.shard(logical, plan)
    tx = optax.sgd(0.1)
    opt_state = vj.init_opt_state(tx, params)
    x = jnp.linspace(-1.0, 1.0, 16 * 48, dtype=jnp.float32).reshape(16, 48)
    fp8 = vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32, fp8_gather=(16, 16))

    @vj.fsdp(kernels=MOSAIC, precision=fp8)
    def step(params, opt_state, x):
        def loss(p):
            return jnp.mean(vj.apply(lambda t, x: jnp.sum((x @ t["a"]["w"] + t["a"]["b"][:1]) ** 2, -1), p, x))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    text = step.lower(params, opt_state, x, lowering_platforms=("cuda",)).as_text()
    assert MOSAIC_CALL in text and any(c[0] == "all_gather" and c[2] == "ui8" for c in census(text))
    assert (TRITON_CALL in text) == (width != 16 and not tiles)


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
    plan = gpt_plan()
    step, args = gpt_step(plan, ADAMW, kernels=MOSAIC)
    text = export_cuda(step, args)
    check_module(text, plan, call=MOSAIC_CALL, reference=reference_text(plan, ADAMW))
    assert TRITON_CALL not in text


@pytest.mark.parametrize("reduce_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16-reduce", "fp32-reduce"])
def test_mosaic_mixed_precision(reduce_dtype):
    """bf16 gathers (the fp32 -> bf16 cast fused in the gather's pack) and gradients reduced in bf16 or fp32 (the
    bf16 -> fp32 cast fused in the gradient pack): every pack and unpack on Mosaic GPU."""
    plan = gpt_plan()
    precision = vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=reduce_dtype)
    step, args = gpt_step(plan, ADAMW, kernels=MOSAIC, precision=precision)
    ref = reference_text(plan, ADAMW, precision=precision)
    text = export_cuda(step, args)
    check_module(text, plan, call=MOSAIC_CALL, reference=ref, wire="bf16")
    assert TRITON_CALL not in text


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
    assert DEFAULT_CALL in cuda and (TRITON_CALL in cuda) == (DEFAULT_CALL == TRITON_CALL)
    # Mosaic GPU: its packs and unpacks, the FP8 quantize / dequantize (tiles that are the blocks) and the tile
    # relayout of the gradients' pack: no Triton call
    step, args = gpt_step(plan, ADAMW, kernels=MOSAIC, precision=fp8)
    mosaic = export_cuda(step, args)
    check_module(mosaic, plan, call=MOSAIC_CALL, reference=ref, wire="ui8", every_bucket=False)
    assert TRITON_CALL not in mosaic


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
    plan = gpt_plan(hsdp_mesh())
    options = dict(data_axes=("replica", "fsdp"))
    step, args = gpt_step(plan, ADAMW, kernels=kernels, **options)
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


def test_checkpoint_conversions_to_host_memory_lower_for_cuda():
    """A background save's conversion programs, as they run (one per bucket; a layered bucket's per-layer step
    and its last program), lowered for CUDA: the last program of every bucket places the leaves in pinned host
    memory itself, and none calls back to the host."""
    from vescale_jax.relayout import _logical_leaves as logical

    plan = gpt_plan()
    placed = '_xla_buffer_placement = "pinned_host"'
    layered = 0
    for b, bucket in enumerate(plan.buckets):
        is_layered, programs = logical.out_programs(plan, b, bucket.dtype, "pinned_host")
        texts = [fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text() for fn, args in programs if fn]
        assert len(texts) == 1 + is_layered, bucket.name
        assert placed in texts[-1], bucket.name
        assert (placed in texts[0]) == (not is_layered), bucket.name  # a layered step keeps its leaves in place
        assert not any(name in text for text in texts for name in CALLBACKS)
        layered += is_layered
    assert 0 < layered < len(plan.buckets), "the plan has a layered bucket and one converted in one call"
