"""vj.optim.muon's compiled update: temp memory against optax.contrib.muon under JAX's FSDP sharding."""

from conftest import make_mesh
from helpers import load_script

from vescale_jax import testing


def test_update_temp_at_most_optax_under_fsdp():
    # benchmarks/muon.py's tree on 8 devices: the owner routing's temporaries (all-to-all messages, work arrays,
    # Newton-Schulz iterates, the AdamW branch's full-size scatter) stay below what XLA's own partitioning of
    # optax.contrib.muon needs, and follow what a device owns (a few times its Newton-Schulz work arrays).
    make_mesh(8)  # skips when fewer devices are simulated
    bench = load_script("benchmarks/muon.py")
    routing, ours, base = bench.compile_pair(8)
    temp = testing.memory(ours).temp
    assert temp <= testing.memory(base).temp
    assert temp <= bench.TEMP_PER_OWNED * routing.work_size * 4
