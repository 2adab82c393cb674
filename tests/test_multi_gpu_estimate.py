"""benchmarks/multi_gpu_estimate.py: runs, labels itself an estimate, and its numbers hang together."""

import dataclasses

import pytest
from helpers import load_script

est = load_script("benchmarks/multi_gpu_estimate.py")


def test_collective_time_follows_bytes_over_bandwidth():
    hw = est.Hardware()
    x = 1e9
    assert est.collective_s(x, 1, hw) == 0.0
    assert est.collective_s(x, 8, hw) == pytest.approx(7 / 8 * x / 450e9)
    assert est.collective_s(2 * x, 8, hw) == pytest.approx(2 * est.collective_s(x, 8, hw))
    # 8 nodes: the NICs bound it, (n-1)/n·X over 8 × 50 GB/s
    assert est.collective_s(x, 64, hw) == pytest.approx(7 / 8 * x / 400e9)
    fast = dataclasses.replace(hw, nic_gbs=100.0, nvlink_gbs=900.0)
    assert est.collective_s(x, 64, fast) == pytest.approx(est.collective_s(x, 64, hw) / 2)
    with pytest.raises(ValueError, match="whole nodes"):
        est.collective_s(x, 12, hw)


@pytest.mark.parametrize("m", [8, 64])
def test_estimate_is_self_consistent(m):
    wl = est.Workload()
    e = est.estimate("llama3-8b", m, wl=wl)
    assert e.params == 8_030_261_248  # Llama-3-8B
    assert 0 <= e.padding < 0.01
    bs = est.bucket_costs("llama3-8b", m, est.Hardware(), wl)
    # gather time = Σ buckets gathers × (m-1)/m·(m·S·2 bytes) / bandwidth (one node)
    # (the embedding is gathered once: its gradient needs no values)
    assert [b.gathers for b in bs] == [1] + [2] * (len(bs) - 1)
    if m == 8:
        want = sum(b.gathers * 7 / 8 * b.elements * 2 / 450e9 for b in bs)
        assert e.all_gather_s == pytest.approx(want)
    embed = bs[0].ag_s
    assert e.all_gather_s == pytest.approx(2 * e.reduce_scatter_s - embed)
    assert e.step_no_overlap_s == pytest.approx(e.compute_s + e.all_gather_s + e.reduce_scatter_s)
    assert e.compute_s <= e.step_overlap_s <= e.step_no_overlap_s
    # compute: (6N + 12·L·d·T)·tokens at u·peak, embedding excluded
    n = e.params - 128256 * 4096 - 4096  # minus embedding and final norm (lookups)
    flops = (6 * n + 12 * 32 * 4096 * 8192) * 8192
    assert e.model_flops_per_gpu == pytest.approx(flops, rel=1e-9)
    assert e.compute_s == pytest.approx(flops / (0.5 * 989e12))
    assert e.mfu(e.compute_s) == pytest.approx(0.5)


def test_overlap_hides_less_when_compute_shrinks():
    big = est.estimate("llama3-8b", 64)
    small = est.estimate("llama3-8b", 64, wl=est.Workload(seq=256, tokens_per_gpu=256))
    exposed = lambda e: e.step_overlap_s - e.compute_s
    assert exposed(small) >= exposed(big)
    assert small.all_gather_s == pytest.approx(big.all_gather_s)  # bytes do not depend on tokens


def test_script_writes_a_page_labelled_as_an_estimate(tmp_path, capsys):
    out = tmp_path / "estimate.md"
    assert est.main(["--models", "llama3-8b", "--gpus", "8", "--tokens-per-gpu", "8192", "--out", str(out)]) == 0
    text = out.read_text()
    assert "estimate, not a measurement" in text
    assert "MaxText's published figure" in text
    assert "| llama3-8b | 8 | 8192 | 8192 |" in text
