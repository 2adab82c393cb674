"""Test set-up: simulate CPU devices before JAX is imported.

``VESCALE_JAX_TEST_DEVICES`` (default 8) sets how many; tests build meshes of 1, 2, 3 and 8 devices out of
them (sizes larger than what is available are skipped).
"""

import os

_N = int(os.environ.get("VESCALE_JAX_TEST_DEVICES", "8"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_N}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Simulated devices are threads of one process: one OpenBLAS thread per LAPACK call (eigendecompositions).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

DEVICE_COUNTS = (1, 2, 3, 8)


def make_mesh(m: int, axis: str = "fsdp", *, auto: bool = False) -> jax.sharding.Mesh:
    if m > len(jax.devices()):
        pytest.skip(f"needs {m} devices, {len(jax.devices())} available")
    types = (jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit,)
    return jax.make_mesh((m,), (axis,), axis_types=types, devices=jax.devices()[:m])


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda m: f"m{m}")
def mesh(request):
    return make_mesh(request.param)
