"""An estimate, not a measurement: vj.fsdp's all-gather and reduce-scatter time per step against compute,
for Llama-3-8B and Llama-3-70B shapes on 8 and 64 H200s, with and without prefetch overlap.

Nothing here runs on a GPU. The bytes come from the plan: every bucket of ``benchmarks/model_configs.py``
(embedding, one bucket per transformer layer, final norm, head) is laid out by ``vj.plan_bucket`` for ``m``
devices (``rows(1)`` blocks, 16-byte alignment), and its gathered buffer is ``m·S`` elements. The rest is a
stated model (``MODEL`` below, written into the report):

- wire: bf16 (2 bytes / element) for the all-gather and the reduce-scatter; with reshard-after-forward every
  bucket is gathered twice (forward, and again in backward) but the embedding (its gradient needs no values:
  gathered once, as the compiled census of ``benchmarks/fsdp_step.py`` shows), and reduce-scattered once;
- a collective over a buffer of ``X`` bytes on ``m`` GPUs: one node (``m ≤ 8``): ring, each GPU sends
  ``(m−1)/m·X`` over NVLink at ``B_nv`` = 450 GB/s (900 GB/s per GPU is the bidirectional figure; a ring
  sends one way); ``n = m/8`` nodes: hierarchical / one ring per NIC, each node must move ``(n−1)/n·X``
  through its 8 NICs of 400 Gb/s = 50 GB/s each while the intra-node part moves ``7/8·X`` over NVLink,
  concurrently: ``t = max((n−1)/n·X / (8·50 GB/s), 7/8·X / B_nv)``;
- compute per bucket: ``6·N_b·tokens`` (+ ``12·d·T·tokens`` per transformer layer: attention, PaLM's
  non-causal count) at a stated fraction ``u`` of 989 TFLOP/s (H200 bf16 dense); one third forward, two thirds
  backward; embedding and norm buckets compute nothing (lookups);
- no overlap: step = compute + all gathers + all reduce-scatters; prefetch overlap: forward
  ``ag_0 + Σ_i max(c_f,i, ag_{i+1})``, backward ``ag_last + Σ_j max(c_b,j, ag_{j−1} + rs_{j+1}) + rs_first``
  (a bucket's re-gather and its successor's reduce-scatter share the links).

    python benchmarks/multi_gpu_estimate.py [--out docs/multi_gpu_estimate.md] [--utilisation 0.5]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_configs import LLAMA3_8B, LLAMA3_70B, buckets

import vescale_jax as vj

MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
HBM_GB = 141.0  # H200 memory per GPU
MAXTEXT = (
    "MaxText's published figure for Llama-3.1-70B on 256 H200 (bf16, sequence 8192): about 51 % MFU, about "
    "1,056 tokens/s per GPU (MaxText's performance table for H200; NVIDIA's DGXC MaxText Llama-3-70B recipe "
    "shows a similar example log line, 1,052 tokens/s/device and 506.6 TFLOP/s/device on 128 GPUs of its cluster: "
    "https://catalog.ngc.nvidia.com/orgs/nvidia/teams/dgxc-benchmarking/resources/maxtext-llama3-70b-dgxc-benchmarking-g)"
)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The machine of the model (H200 nodes of 8 GPUs).

    Attributes:
      peak_tflops: bf16 dense peak per GPU.
      nvlink_gbs: bytes per second one GPU sends over NVLink in one direction (900 GB/s bidirectional ÷ 2).
      nic_gbs: bytes per second one GPU's NIC sends between nodes (400 Gb/s).
      gpus_per_node: GPUs sharing one NVLink domain.
    """

    peak_tflops: float = 989.0
    nvlink_gbs: float = 450.0
    nic_gbs: float = 50.0
    gpus_per_node: int = 8


@dataclasses.dataclass(frozen=True)
class Workload:
    """The step of the model.

    Attributes:
      seq: sequence length T.
      tokens_per_gpu: tokens each GPU computes per step.
      utilisation: fraction of the peak the compute reaches (assumed, not measured).
      wire_bytes: bytes per element on the wire (bf16: 2).
      gathers: all-gathers per bucket per step (2: reshard after forward, re-gathered in backward).
    """

    seq: int = 8192
    tokens_per_gpu: int = 8192
    utilisation: float = 0.5
    wire_bytes: int = 2
    gathers: int = 2


def collective_s(nbytes: float, m: int, hw: Hardware) -> float:
    """Seconds of one all-gather (or reduce-scatter) of a buffer of ``nbytes`` over ``m`` GPUs (see MODEL).

    Args:
      nbytes: bytes of the full (gathered) buffer X.
      m: GPUs.
      hw: the machine.

    Returns:
      Seconds.
    """
    if m <= 1:
        return 0.0
    g = hw.gpus_per_node
    if m <= g:
        return (m - 1) / m * nbytes / (hw.nvlink_gbs * 1e9)
    if m % g:
        raise ValueError(f"m={m}: use whole nodes of {g} GPUs")
    n = m // g
    inter = (n - 1) / n * nbytes / (g * hw.nic_gbs * 1e9)
    intra = (g - 1) / g * nbytes / (hw.nvlink_gbs * 1e9)
    return max(inter, intra)


@dataclasses.dataclass(frozen=True)
class BucketCost:
    name: str
    elements: int  # m·S: the gathered buffer
    params: int
    padding: float
    ag_s: float  # one all-gather
    gathers: int  # all-gathers per step
    rs_s: float  # one reduce-scatter
    fwd_s: float
    bwd_s: float


def bucket_costs(model: str, m: int, hw: Hardware, wl: Workload) -> list[BucketCost]:
    """Each bucket's plan (``vj.plan_bucket``), collective times and compute times, in forward order."""
    cfg = MODELS[model]
    d, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    out = []
    for name, params in buckets(model):
        sizes = [math.prod(s) for _, s in params]
        blocks = [s[-1] if len(s) > 1 else 1 for _, s in params]  # rows(1)
        layout = vj.plan_bucket(sizes, blocks, m, align=16 // wl.wire_bytes)
        elements = layout.num_devices * layout.shard_size
        x = elements * wl.wire_bytes
        n = sum(sizes)
        if name.startswith("layers."):
            flops = 6.0 * n * wl.tokens_per_gpu + 12.0 * d * wl.seq * wl.tokens_per_gpu
        elif name == "lm_head":
            flops = 6.0 * n * wl.tokens_per_gpu
        else:  # embedding lookup, final norm
            flops = 0.0
        c = flops / (wl.utilisation * hw.peak_tflops * 1e12)
        out.append(
            BucketCost(
                name=name,
                elements=elements,
                params=n,
                padding=layout.padding_fraction,
                ag_s=collective_s(x, m, hw),
                gathers=1 if name == "embed" else wl.gathers,
                rs_s=collective_s(x, m, hw),
                fwd_s=c / 3,
                bwd_s=2 * c / 3,
            )
        )
    assert len([b for b in out if b.name.startswith("layers.")]) == n_layers
    return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    model: str
    gpus: int
    params: int
    padding: float
    compute_s: float
    all_gather_s: float
    reduce_scatter_s: float
    step_no_overlap_s: float
    step_overlap_s: float
    state_gb_per_gpu: float
    tokens_per_gpu: int
    seq: int
    model_flops_per_gpu: float
    peak_tflops: float

    def mfu(self, step_s: float) -> float:
        """Model FLOPs ÷ step time ÷ peak."""
        return self.model_flops_per_gpu / step_s / (self.peak_tflops * 1e12)

    def tokens_per_s(self, step_s: float) -> float:
        """Tokens per second per GPU."""
        return self.tokens_per_gpu / step_s


def estimate(model: str, m: int, *, hw: Hardware = Hardware(), wl: Workload = Workload()) -> Estimate:
    """The step estimate of ``model`` on ``m`` GPUs (see MODEL).

    Args:
      model: ``"llama3-8b"`` or ``"llama3-70b"``.
      m: GPUs (one FSDP axis over all of them).
      hw: the machine.
      wl: the step.

    Returns:
      The :class:`Estimate`.
    """
    bs = bucket_costs(model, m, hw, wl)
    compute = sum(b.fwd_s + b.bwd_s for b in bs)
    ag = sum(b.gathers * b.ag_s for b in bs)
    rs = sum(b.rs_s for b in bs)
    # prefetch overlap: forward in bucket order, backward in reverse
    fwd = bs[0].ag_s + sum(max(b.fwd_s, bs[i + 1].ag_s if i + 1 < len(bs) else 0.0) for i, b in enumerate(bs))
    rev = bs[::-1]
    bwd_ag = lambda b: b.ag_s if b.gathers > 1 else 0.0  # re-gathered in backward
    bwd = bwd_ag(rev[0]) + rev[-1].rs_s
    for j, b in enumerate(rev):
        nxt_ag = bwd_ag(rev[j + 1]) if j + 1 < len(rev) else 0.0
        prev_rs = rev[j - 1].rs_s if j > 0 else 0.0
        bwd += max(b.bwd_s, nxt_ag + prev_rs)
    params = sum(b.params for b in bs)
    elements = sum(b.elements for b in bs)
    flops = sum((b.fwd_s + b.bwd_s) for b in bs) * wl.utilisation * hw.peak_tflops * 1e12
    return Estimate(
        model=model,
        gpus=m,
        params=params,
        padding=1 - params / elements,
        compute_s=compute,
        all_gather_s=ag,
        reduce_scatter_s=rs,
        step_no_overlap_s=compute + ag + rs,
        step_overlap_s=fwd + bwd,
        state_gb_per_gpu=12 * elements / m / 1e9,
        tokens_per_gpu=wl.tokens_per_gpu,
        seq=wl.seq,
        model_flops_per_gpu=flops,
        peak_tflops=hw.peak_tflops,
    )


def report(rows: list[Estimate], hw: Hardware, wl: Workload) -> str:
    """The markdown page: the model written out, the table, MaxText's figure beside it."""
    lines = [
        "# Multi-GPU estimate (estimate, not a measurement)",
        "",
        "**This page is an estimate computed by `benchmarks/multi_gpu_estimate.py`, not a measurement**: no",
        "multi-GPU machine has run vj.fsdp. The bytes come from the plan (`vj.plan_bucket` on every bucket of",
        "`benchmarks/model_configs.py`, `rows(1)` blocks, 16-byte alignment); the times come from the model below.",
        "",
        "## The model",
        "",
        "- Tokens per GPU per step: the table's column, whole sequences of length T (the T column: 8192 as"
        " Llama-3 was trained, shorter when a GPU has fewer tokens); one FSDP axis over all GPUs. The smaller"
        " token count shows where the collectives stop hiding behind compute.",
        f"- Compute: per transformer-layer bucket `6·N_b·tokens + 12·d·T·tokens` FLOPs (attention: PaLM's"
        f" non-causal count), the head `6·N_head·tokens`, embedding and norms 0 (lookups); run at an assumed"
        f" utilisation u = {wl.utilisation:.2f} of {hw.peak_tflops:.0f} TFLOP/s (H200 bf16 dense); one third"
        " forward, two thirds backward.",
        f"- Wire: bf16 ({wl.wire_bytes} bytes per element) for both collectives; every bucket all-gathered"
        f" {wl.gathers}× per step (reshard after forward: again in backward) except the embedding (gathered"
        " once: its gradient needs no values; the compiled census of `benchmarks/fsdp_step.py` on 8 CPU devices"
        " counts the same, all-gather wire bytes within 0.1 % of this ideal, `benchmarks/results/fsdp_step.md`),"
        " and reduce-scattered once. A float32 reduce-scatter would double the reduce-scatter column.",
        f"- A collective over a buffer of X bytes on m GPUs: one node (m ≤ {hw.gpus_per_node}), ring:"
        f" `(m−1)/m·X / B_nv`, B_nv = {hw.nvlink_gbs:.0f} GB/s per direction (NVLink's 900 GB/s per GPU is"
        f" the bidirectional figure); n = m/{hw.gpus_per_node} nodes:"
        f" `max((n−1)/n·X / ({hw.gpus_per_node}·{hw.nic_gbs:.0f} GB/s), {hw.gpus_per_node - 1}/"
        f"{hw.gpus_per_node}·X / B_nv)` (400 Gb/s = {hw.nic_gbs:.0f} GB/s per GPU NIC, hierarchical or one"
        " ring per NIC, inter- and intra-node parts concurrent). Latency terms and NCCL efficiency are ignored"
        " (both make real collectives slower).",
        "- No overlap: step = compute + all-gathers + reduce-scatters. Prefetch overlap: forward"
        " `ag_0 + Σ_i max(fwd_i, ag_{i+1})`, backward `ag_last + Σ_j max(bwd_j, ag_{j−1} + rs_{j+1}) + rs_first`"
        " over buckets in forward order (embedding, 1 per layer, final norm, head).",
        "- The bytes come from the plan, not from a compiled multi-GPU program; the compiled census of a"
        " small model on 8 CPU devices (above) is what ties the plan's bytes to what XLA emits.",
        "- State: 12 bytes per parameter per GPU ÷ m (fp32 master + two fp32 Adam moments); activations,"
        " gradients and gathered buffers are not modelled (memory is not estimated beyond this).",
        "- MFU = model FLOPs ÷ step time ÷ peak, the same FLOPs as the compute row.",
        "",
        "## Figures (estimate)",
        "",
        "| model | GPUs | tokens/GPU | T | params | padding | state GB/GPU | compute s | all-gather s "
        "| reduce-scatter s | step s, no overlap | step s, overlap | MFU no overlap | MFU overlap "
        "| tokens/s/GPU overlap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in rows:
        lines.append(
            f"| {e.model} | {e.gpus} | {e.tokens_per_gpu} | {e.seq} | {e.params / 1e9:.2f} B | {100 * e.padding:.3f} % "
            f"| {e.state_gb_per_gpu:.1f} "
            f"| {e.compute_s:.3f} | {e.all_gather_s:.3f} | {e.reduce_scatter_s:.3f} | {e.step_no_overlap_s:.3f} "
            f"| {e.step_overlap_s:.3f} | {100 * e.mfu(e.step_no_overlap_s):.1f} % "
            f"| {100 * e.mfu(e.step_overlap_s):.1f} % | {e.tokens_per_s(e.step_overlap_s):,.0f} |"
        )
    tight = {(e.model, e.gpus): e.state_gb_per_gpu for e in rows if e.state_gb_per_gpu > 0.6 * HBM_GB}
    lines += [""]
    for (model, m), gb in tight.items():
        lines.append(
            f"{model} on {m} GPUs: the state alone takes {100 * gb / HBM_GB:.0f} % of the {HBM_GB:.0f} GB of an"
            " H200; gradients, gathered layers and activations must fit in the rest (memory is not modelled here)."
        )
    lines += [
        "",
        f"Beside it: {MAXTEXT}. MaxText counts causal attention at half the FLOPs, so its MFU and ours differ"
        " in the attention term; with overlap the estimate's MFU is the assumed utilisation u minus what stays"
        " exposed, so it says how much communication costs, not what utilisation a GPU reaches.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="markdown file to write (e.g. docs/multi_gpu_estimate.md)")
    p.add_argument("--models", default="llama3-8b,llama3-70b")
    p.add_argument("--gpus", default="8,64")
    p.add_argument("--utilisation", type=float, default=Workload.utilisation)
    p.add_argument("--tokens-per-gpu", default="8192,2048", help="one row each (T = min(--seq, tokens))")
    p.add_argument("--seq", type=int, default=Workload.seq)
    args = p.parse_args(argv)
    hw = Hardware()
    wls = [
        Workload(seq=min(args.seq, int(t)), tokens_per_gpu=int(t), utilisation=args.utilisation)
        for t in args.tokens_per_gpu.split(",")
    ]
    wl = wls[0]
    rows = [
        estimate(model, int(m), hw=hw, wl=w)
        for w in wls
        for model in args.models.split(",")
        for m in args.gpus.split(",")
    ]
    text = report(rows, hw, wl)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
