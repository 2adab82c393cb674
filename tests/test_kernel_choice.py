"""``KernelPolicy(mode="auto")``: a Pallas kernel only where a recorded GPU run showed it faster than XLA."""

import json

import jax.numpy as jnp
import pytest

import vescale_jax as vj
from vescale_jax.kernels import KernelPolicy, MeasuredTable, Record, _measured, shipped_table, size_class

H200 = "NVIDIA H200"
DEFAULT = vj.kernels.default_gpu_backend()  # what a policy without a backend compiles on this JAX
BIG = vj.plan_bucket([4096 * 4096, 4096], [4096, 1], 8, align=4)  # 64 MiB fp32: "large"
SMALL = vj.plan_bucket([64, 128, 8], [1, 1, 1], 8, align=4)  # < 1 MiB: "small"


def rec(**kw) -> Record:
    base = dict(
        device_kind=H200,
        backend=DEFAULT,
        direction="unpack",
        src="float32",
        dst="float32",
        size_class="large",
        xla_ms=1.0,
        pallas_ms=0.8,
        jax="0.11.0",
    )
    return Record(**{**base, **kw})


SYNTHETIC = MeasuredTable(
    records=(
        rec(),  # unpack f32->f32, large: kernel 1.25x faster
        rec(direction="pack", dst="bfloat16", pallas_ms=1.2),  # pack slower
        rec(direction="unpack", dst="bfloat16", pallas_ms=0.98),  # 2 % ahead: within noise, not enough
    )
)


@pytest.fixture
def gpu(monkeypatch):
    """Stand in an H200 for the device-kind lookup (the policy is asked with platform="gpu")."""
    monkeypatch.setattr(_measured, "_device_kind", lambda platform: H200)


def test_shipped_table_is_json_and_empty_so_auto_is_xla_everywhere(gpu):
    assert shipped_table() == MeasuredTable()
    with open(_measured.SHIPPED) as f:
        assert json.load(f) == {"format": 1, "records": []}
    policy = KernelPolicy()
    for platform in ("cpu", "gpu", "cuda"):
        for direction in ("pack", "unpack", None):
            for layout in (BIG, SMALL):
                for dst in (jnp.float32, jnp.bfloat16):
                    got = policy.implementation(layout, jnp.float32, dst, platform=platform, direction=direction)
                    assert got == "xla", (platform, direction, layout.total_size, dst)


def test_auto_picks_pallas_only_for_the_recorded_faster_case(gpu):
    policy = KernelPolicy(measured=SYNTHETIC)
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert policy.implementation(BIG, f32, f32, platform="gpu", direction="unpack") == DEFAULT
    assert policy.implementation(BIG, f32, f32, platform="cuda", direction="unpack") == DEFAULT
    # not measured: other direction, other size class, other device kind, direction unknown
    assert policy.implementation(BIG, f32, f32, platform="gpu", direction="pack") == "xla"
    assert policy.implementation(SMALL, f32, f32, platform="gpu", direction="unpack") == "xla"
    assert policy.implementation(BIG, f32, f32, platform="gpu", direction=None) == "xla"
    # measured slower, or ahead by less than MIN_SPEEDUP
    assert policy.implementation(BIG, f32, bf16, platform="gpu", direction="pack") == "xla"
    assert policy.implementation(BIG, f32, bf16, platform="gpu", direction="unpack") == "xla"
    # never on CPU, and never interpreted
    assert policy.implementation(BIG, f32, f32, platform="cpu", direction="unpack") == "xla"
    assert not policy.interprets("cpu") and policy.check_vma


def test_auto_uses_the_backend_that_would_run():
    """The record of the backend that would run decides: each backend takes the cast, so the preferred one runs
    and another backend's record does not count."""
    only_mosaic = MeasuredTable(records=(rec(backend="mosaic_gpu", dst="bfloat16"),))
    only_triton = MeasuredTable(records=(rec(backend="triton", dst="bfloat16"),))
    kw = dict(direction="unpack", platform="gpu", backend="mosaic_gpu", device_kind=H200)
    assert _measured.auto_implementation(only_mosaic, BIG, jnp.float32, jnp.bfloat16, **kw) == "mosaic_gpu"
    assert _measured.auto_implementation(only_triton, BIG, jnp.float32, jnp.bfloat16, **kw) == "xla"
    triton = dict(kw, backend="triton")
    assert _measured.auto_implementation(only_triton, BIG, jnp.float32, jnp.bfloat16, **triton) == "triton"
    other_gpu = dict(triton, device_kind="NVIDIA A100-SXM4-80GB")
    assert _measured.auto_implementation(only_triton, BIG, jnp.float32, jnp.bfloat16, **other_gpu) == "xla"


def test_conflicting_records_for_one_case_mean_xla():
    table = MeasuredTable(records=(rec(), rec(pallas_ms=1.1)))
    assert table.cases() == ()
    assert SYNTHETIC.cases() == (rec(),)
    assert not table.faster(
        backend=DEFAULT, direction="unpack", src_dtype="float32", dst_dtype="float32", nbytes=1 << 30, device_kind=H200
    )


def test_table_from_env_round_trips_through_json(tmp_path, gpu):
    path = tmp_path / "measured.json"
    SYNTHETIC.to_json(path)
    assert MeasuredTable.from_json(path) == SYNTHETIC
    policy = KernelPolicy.from_env({"VESCALE_JAX_KERNEL_TABLE": str(path)})
    assert policy.measured == SYNTHETIC and policy.mode == "auto"
    assert hash(policy) == hash(KernelPolicy(measured=SYNTHETIC))
    assert policy.implementation(BIG, jnp.float32, jnp.float32, platform="gpu", direction="unpack") == DEFAULT
    assert KernelPolicy.from_env({}).measured is None


def test_size_classes():
    assert [size_class(n) for n in (0, (1 << 20) - 1, 1 << 20, (64 << 20) - 1, 64 << 20)] == [
        "small",
        "small",
        "medium",
        "medium",
        "large",
    ]


def test_bad_tables_are_refused_with_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="format"):
        MeasuredTable.from_dict({"format": 2, "records": []})
    with pytest.raises(ValueError, match="unknown keys"):
        MeasuredTable.from_dict({"format": 1, "records": [{**rec().__dict__, "speed": 2}]})
    with pytest.raises(ValueError, match="direction"):
        rec(direction="gather")
    with pytest.raises(ValueError, match="size_class"):
        rec(size_class="huge")
    with pytest.raises(ValueError, match="positive"):
        rec(pallas_ms=0.0)
