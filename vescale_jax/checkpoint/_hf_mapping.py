"""How a parameter tree's leaves map to the tensors of a Hugging Face checkpoint.

A :class:`Mapping` is a tuple of :class:`Entry` s. An entry's ``leaf`` is a key-path pattern (``"model/layers/{i}/
self_attn/q_proj/kernel"``, matched against the plan's ``LeafSpec.path``, a leading Linen ``params/`` ignored); its
``tensors`` are tensor-name patterns (``"model.layers.{i}.self_attn.q_proj.weight"``); its ``ops`` turn the file's
tensor into the leaf (in the load direction; a save runs them backwards):

- several ``tensors``: concatenated along ``axis`` (their sizes along it: ``sections``, default equal);
- a placeholder in ``tensors`` but not in ``leaf`` (``{i}``): the tensors of every index present in the files are
  stacked along a new leading dim, in numeric order (a stacked layer group);
- :class:`Transpose`, :class:`SplitDim` / :class:`MergeDims` (reshapes: ``(H*D, X)`` <-> ``(H, D, X)``) and
  :class:`Split` (one part of a fused tensor: GPT-2's ``c_attn`` into q, k, v), applied in order;
- a dtype cast from the file's dtype to the leaf's (widening by default; see ``cast=`` of the load and save).

Every leaf element comes from exactly one tensor element, so the ops are index arithmetic
(:mod:`vescale_jax.checkpoint._hf_index`), never a materialised tensor. The ready mappings target transformers' own
Flax models and name and shape the tensors as its PyTorch ``save_pretrained`` writes them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Sequence

__all__ = [
    "Entry",
    "Mapping",
    "MergeDims",
    "Split",
    "SplitDim",
    "Transpose",
    "gpt2_mapping",
    "llama_mapping",
    "placeholders",
]


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Permutes dims: output dim ``j`` is input dim ``perm[j]`` (``None``: reverse them; a PyTorch ``Linear``'s
    ``(out, in)`` weight to Flax's ``(in, out)`` kernel)."""

    perm: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class SplitDim:
    """Splits dim ``axis`` into dims of ``sizes`` (one may be -1), row-major: ``(H*D, X)`` -> ``(H, D, X)`` with
    ``SplitDim(0, (H, -1))``. The inverse of :class:`MergeDims` with the same arguments."""

    axis: int
    sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MergeDims:
    """Merges ``len(sizes)`` dims from ``axis`` (of ``sizes``, one may be -1) into one, row-major: ``(H, D, X)``
    -> ``(H*D, X)`` with ``MergeDims(0, (H, -1))``. The inverse of :class:`SplitDim`."""

    axis: int
    sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Split:
    """Part ``index`` of a fused tensor cut along ``axis`` into ``sections`` (a count of equal parts, or the
    parts' sizes): GPT-2's fused ``(in, 3*out)`` qkv weight gives q with ``Split(1, 0, 3)``. On save, the leaves
    of every part are written into the one tensor."""

    axis: int
    index: int
    sections: int | tuple[int, ...]


Op = Transpose | SplitDim | MergeDims | Split


@dataclasses.dataclass(frozen=True)
class Entry:
    """One rule: leaves matching ``leaf`` come from ``tensors`` through ``ops``.

    Attributes:
      leaf: key-path pattern, ``/``-separated; ``{name}`` matches one path component.
      tensors: tensor-name pattern(s); ``{name}`` matches one ``.``-separated component (a name the leaf pattern
        lacks stacks the tensors along a new leading dim).
      ops: applied in order, in the load direction (tensor -> leaf).
      axis: the dim several ``tensors`` are concatenated along (in the tensors' own dims).
      sections: their sizes along ``axis`` (``None``: equal).
      optional: a leaf that only some models have (a bias); no error when no leaf matches it.
    """

    leaf: str
    tensors: tuple[str, ...]
    ops: tuple[Op, ...] = ()
    axis: int = 0
    sections: tuple[int, ...] | None = None
    optional: bool = False

    def __post_init__(self):
        if isinstance(self.tensors, str):
            object.__setattr__(self, "tensors", (self.tensors,))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.tensors:
            raise ValueError(f"mapping entry for {self.leaf!r} names no tensor.")
        leaf_names = set(placeholders(self.leaf))
        for t in self.tensors:
            extra = set(placeholders(t)) - leaf_names
            if len(extra) > 1:
                raise ValueError(
                    f"mapping entry {self.leaf!r} -> {t!r}: at most one placeholder may be absent from the leaf "
                    f"pattern (it stacks the tensors); found {sorted(extra)}."
                )
        if len({frozenset(placeholders(t)) for t in self.tensors}) > 1:
            raise ValueError(f"mapping entry {self.leaf!r}: tensors {self.tensors} use different placeholders.")
        missing = leaf_names - set(placeholders(self.tensors[0]))
        if missing:
            raise ValueError(
                f"mapping entry {self.leaf!r} -> {self.tensors}: placeholder(s) {sorted(missing)} of the leaf "
                "pattern appear in no tensor pattern."
            )

    @property
    def stack(self) -> str | None:
        """The placeholder the tensors are stacked over (``None``: not stacked)."""
        extra = [p for p in placeholders(self.tensors[0]) if p not in placeholders(self.leaf)]
        return extra[0] if extra else None


def placeholders(pattern: str) -> list[str]:
    """The ``{name}`` placeholders of a pattern, in order."""
    return re.findall(r"\{(\w+)\}", pattern)


def compile_pattern(pattern: str, sep: str) -> re.Pattern:
    """A regex for a pattern: each ``{name}`` matches one ``sep``-separated component (a named group)."""
    out, pos, seen = [], 0, set()
    for m in re.finditer(r"\{(\w+)\}", pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        name = m.group(1)
        out.append(f"(?P={name})" if name in seen else f"(?P<{name}>[^{re.escape(sep)}]+)")
        seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


@dataclasses.dataclass(frozen=True)
class Mapping:
    """Entries (the first entry matching a leaf wins) and the checkpoint tensors no leaf uses on purpose.

    Attributes:
      entries: the rules.
      ignore: ``fnmatch`` patterns of tensor names a load skips (buffers such as ``*.rotary_emb.inv_freq``).
    """

    entries: tuple[Entry, ...]
    ignore: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "ignore", (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore))

    def __add__(self, other: Mapping) -> Mapping:
        return Mapping((*self.entries, *other.entries), (*self.ignore, *other.ignore))

    def ignored(self, name: str, extra: Sequence[str] = ()) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in (*self.ignore, *extra))


def _linear(leaf: str, tensor: str, *, optional: bool = False) -> list[Entry]:
    """A PyTorch ``Linear`` -> Flax ``Dense``: the ``(out, in)`` weight transposed, and an optional bias."""
    return [
        Entry(f"{leaf}/kernel", f"{tensor}.weight", (Transpose(),), optional=optional),
        Entry(f"{leaf}/bias", f"{tensor}.bias", optional=True),
    ]


def llama_mapping(*, stacked: bool = False, tied: bool = False, prefix: str = "model.") -> Mapping:
    """Transformers' ``FlaxLlamaForCausalLM`` params <-> the tensors ``LlamaForCausalLM.save_pretrained`` writes.

    Also serves Mistral (the same names) and Qwen2 (adds ``q_proj`` / ``k_proj`` / ``v_proj`` biases: every
    bias entry is optional).

    Args:
      stacked: the layers are one stacked group ``model/layers/...`` with a leading layer dim (e.g. a scanned
        model) instead of ``model/layers/{i}/...``.
      tied: the checkpoint has no ``lm_head.weight`` (``tie_word_embeddings``): a ``lm_head/kernel`` leaf, if the
        tree has one, is the transposed embedding, and a save writes the embedding only.
      prefix: the base model's tensor prefix (``""`` for a bare ``LlamaModel`` checkpoint, whose tree then has
        no leading ``model/`` either).

    Returns:
      The :class:`Mapping`; ``rotary_emb.inv_freq`` buffers are ignored.
    """
    base = "model/" if prefix else ""
    layer, tl = (
        (f"{base}layers", f"{prefix}layers.{{i}}") if stacked else (f"{base}layers/{{i}}", f"{prefix}layers.{{i}}")
    )
    entries = [Entry(f"{base}embed_tokens/embedding", f"{prefix}embed_tokens.weight")]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        entries += _linear(f"{layer}/self_attn/{name}", f"{tl}.self_attn.{name}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        entries += _linear(f"{layer}/mlp/{name}", f"{tl}.mlp.{name}")
    for name in ("input_layernorm", "post_attention_layernorm"):
        entries.append(Entry(f"{layer}/{name}/weight", f"{tl}.{name}.weight"))
    entries.append(Entry(f"{base}norm/weight", f"{prefix}norm.weight"))
    if tied:
        entries.append(Entry("lm_head/kernel", f"{prefix}embed_tokens.weight", (Transpose(),), optional=True))
    else:
        entries.append(Entry("lm_head/kernel", "lm_head.weight", (Transpose(),), optional=not prefix))
    return Mapping(tuple(entries), ignore=("*rotary_emb.inv_freq",))


def gpt2_mapping(*, prefix: str = "transformer.", stacked: bool = False) -> Mapping:
    """Transformers' ``FlaxGPT2LMHeadModel`` params <-> the tensors ``GPT2LMHeadModel.save_pretrained`` writes.

    GPT-2's ``Conv1D`` stores ``(in, out)`` weights, Flax's GPT-2 ``(out, in)`` kernels: every kernel is
    transposed. The LM head is tied to ``wte`` (neither a leaf nor a tensor).

    Args:
      prefix: the tensors' prefix: ``"transformer."`` (``GPT2LMHeadModel``) or ``""`` (a bare ``GPT2Model``
        checkpoint); the leaves are ``transformer/...`` either way.
      stacked: the blocks are one stacked group ``transformer/h/...`` with a leading layer dim.

    Returns:
      The :class:`Mapping`; the ``attn.bias`` / ``attn.masked_bias`` buffers of old checkpoints are ignored.
    """
    h, th = ("transformer/h", f"{prefix}h.{{i}}") if stacked else ("transformer/h/{i}", f"{prefix}h.{{i}}")
    entries = [
        Entry("transformer/wte/embedding", f"{prefix}wte.weight"),
        Entry("transformer/wpe/embedding", f"{prefix}wpe.weight"),
    ]
    for ln in ("ln_1", "ln_2"):
        entries += [Entry(f"{h}/{ln}/scale", f"{th}.{ln}.weight"), Entry(f"{h}/{ln}/bias", f"{th}.{ln}.bias")]
    for conv in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
        t = f"{th}.{conv.replace('/', '.')}"
        entries += [Entry(f"{h}/{conv}/kernel", f"{t}.weight", (Transpose(),)), Entry(f"{h}/{conv}/bias", f"{t}.bias")]
    entries += [
        Entry("transformer/ln_f/scale", f"{prefix}ln_f.weight"),
        Entry("transformer/ln_f/bias", f"{prefix}ln_f.bias"),
    ]
    return Mapping(tuple(entries), ignore=("*.attn.bias", "*.attn.masked_bias", "lm_head.weight"))
