"""Test set-up: simulate CPU devices before JAX is imported.

``VESCALE_JAX_TEST_DEVICES`` (default 8) sets how many; tests build meshes of 1, 2, 3 and 8 devices out of
them (sizes larger than what is available are skipped).
"""

import atexit
import os
import shutil
import tempfile

_N = int(os.environ.get("VESCALE_JAX_TEST_DEVICES", "8"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_N}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Simulated devices are threads of one process: one OpenBLAS thread per LAPACK call (eigendecompositions).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# One persistent compilation cache per test process (a temporary directory, never the user's ~/.cache, nor shared
# between xdist workers, removed at exit): the process's own compiles (a program another test compiled comes from
# it: helpers.counting_compiles counts those too) and its examples' runs in subprocesses (examples/progress.py).
_CACHE = tempfile.mkdtemp(prefix="vescale-jax-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("VESCALE_JAX_COMPILE_CACHE", _CACHE)

import jax  # noqa: E402
import pytest  # noqa: E402
from tiers import fast_entries, heavy_entries  # noqa: E402  (tests/tiers.py: tests/ is on sys.path, as for helpers.py)

jax.config.update("jax_numpy_dtype_promotion", "strict")
if os.environ.get("VESCALE_JAX_TEST_PERSISTENT_CACHE", "1") != "0":  # 0: every test compiles its own programs
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

DEVICE_COUNTS = (1, 2, 3, 8)


def make_mesh(m: int, axis: str = "fsdp", *, auto: bool = False) -> jax.sharding.Mesh:
    if m > len(jax.devices()):
        pytest.skip(f"needs {m} devices, {len(jax.devices())} available")
    types = (jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit,)
    return jax.make_mesh((m,), (axis,), axis_types=types, devices=jax.devices()[:m])


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda m: f"m{m}")
def mesh(request):
    return make_mesh(request.param)


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(config, items):
    """Marks the heavy parametrisations of tests/tiers.py ``slow`` and the tests of the fast tier ``fast``; a stale
    entry is a usage error."""
    entries = fast_entries()
    heavy = heavy_entries()
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path.name, []).append(item)
    narrowed = any("::" in arg for arg in config.args)  # a node id on the command line: not every test collected
    here = os.path.dirname(os.path.abspath(__file__))
    problems = [
        f"{file}: no such test file" for file in {**entries, **heavy} if not os.path.exists(os.path.join(here, file))
    ]
    for file, file_items in by_file.items():
        for entry, regex in heavy.get(file, ()):
            matched = [item for item in file_items if regex.fullmatch(item.name)]
            for item in matched:
                item.add_marker(pytest.mark.slow)
            if not matched and not narrowed:
                problems.append(f"{file}: HEAVY entry {entry!r} matches no test (renamed or removed?)")
    for file, file_items in by_file.items():
        module = file_items[0].module if hasattr(file_items[0], "module") else None
        for entry, regex in entries.get(file, ()):
            name = entry.partition("[")[0]
            if module is not None and not hasattr(module, name):
                problems.append(f"{file}: {entry!r} names no test of the file (renamed or removed?)")
                continue
            matched = [item for item in file_items if regex.fullmatch(item.name)]
            quick = [item for item in matched if item.get_closest_marker("slow") is None]
            for item in quick:
                item.add_marker(pytest.mark.fast)
            if matched and not quick:
                problems.append(f"{file}: {entry!r} names only slow tests; the fast tier takes no slow test")
            elif not matched and not narrowed and any(item.originalname == name for item in file_items):
                problems.append(f"{file}: {entry!r} matches no parametrisation of {name} (its ids changed?)")
    if problems:
        raise pytest.UsageError("tests/tiers.py, the fast tier, is out of date:\n  " + "\n  ".join(problems))
