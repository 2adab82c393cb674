"""vj.checkpoint.load_safetensors / save_safetensors errors: each names the leaf's key path, the tensor, both shapes
(or dtypes) and the fix."""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
from conftest import make_mesh
from safetensors.numpy import load_file, save_file
from test_safetensors import _flax_llama, llama_tensors, shapes_of, write_checkpoint

import vescale_jax as vj
from vescale_jax.checkpoint import Entry, Mapping, Split, SplitDim, llama_mapping
from vescale_jax.checkpoint import _safetensors_files as files

# --- Errors -----------------------------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    tensors = llama_tensors(8)
    tree = _flax_llama(tensors)
    return tensors, tree, vj.plan(shapes_of(tree), make_mesh(2)), tmp_path


def test_error_leaf_without_entry(small):
    tensors, tree, _, tmp = small
    tree["extra"] = {"w": np.zeros(3, np.float32)}
    plan = vj.plan(shapes_of(tree), make_mesh(2))
    with pytest.raises(ValueError, match=r"leaf 'extra/w' \(3,\) float32 has no mapping entry"):
        vj.checkpoint.load_safetensors(write_checkpoint(tensors, tmp / "a", num_files=1), plan, mapping=llama_mapping())


def test_error_missing_tensor_names_near_ones(small):
    tensors, _, plan, tmp = small
    del tensors["model.layers.1.mlp.up_proj.weight"]
    path = write_checkpoint(tensors, tmp / "a", num_files=2)
    with pytest.raises(
        ValueError, match=r"model/layers/1/mlp/up_proj/kernel.*'model.layers.1.mlp.up_proj.weight'.*near"
    ):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())


def test_error_unexpected_tensor_unless_ignored(small):
    tensors, _, plan, tmp = small
    path = write_checkpoint(tensors | {"model.vision.proj": np.ones(2, np.float32)}, tmp / "a", num_files=1)
    with pytest.raises(ValueError, match=r"used by no leaf.*'model.vision.proj'.*ignore="):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping(), ignore=["model.vision.*"])


def test_error_shape_mismatch(small):
    tensors, _, plan, tmp = small
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((4, 16), np.float32)
    path = write_checkpoint(tensors, tmp / "a", num_files=1)
    with pytest.raises(
        ValueError, match=r"model/layers/0/self_attn/k_proj/kernel.*k_proj.weight.*shape mismatch.*\(4, 16\).*\(8, 16\)"
    ):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())


def test_error_narrowing_dtype(small):
    tensors, tree, _, tmp = small
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    plan = vj.plan(shapes_of(tree), make_mesh(2))
    path = write_checkpoint(tensors, tmp / "a", num_files=1)
    with pytest.raises(ValueError, match=r"model/norm/weight.*'model.norm.weight'.*float64.*float32.*cast='any'"):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping(), cast="any")
    np.testing.assert_array_equal(
        vj.unshard(sp)["model"]["norm"]["weight"], tensors["model.norm.weight"].astype(np.float32)
    )


def test_error_entry_matching_no_leaf(small):
    tensors, _, plan, tmp = small
    mapping = llama_mapping() + Mapping((Entry("model/vision/{i}/kernel", "vision.{i}.weight"),))
    with pytest.raises(ValueError, match=r"entry 'model/vision/\{i\}/kernel'.*matches no leaf.*optional=True"):
        vj.checkpoint.load_safetensors(write_checkpoint(tensors, tmp / "a", num_files=1), plan, mapping=mapping)


def test_error_index_names_absent_file(small):
    tensors, _, plan, tmp = small
    path = write_checkpoint(tensors, tmp / "a", num_files=3)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003.safetensors.*tensor"):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())


def _drop_from_its_file(path, name):
    """Rewrites the file the index names for tensor ``name`` without it; the index still names it there."""
    with open(os.path.join(path, files.INDEX)) as f:
        fname = json.load(f)["weight_map"][name]
    file = os.path.join(path, fname)
    kept = {k: v for k, v in load_file(file).items() if k != name}
    save_file(kept, file, metadata={"format": "pt"})
    return fname


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"])
def test_error_index_contradicts_its_file_names_the_file(small, name):
    tensors, _, plan, tmp = small
    path = write_checkpoint(tensors, tmp / "a", num_files=3)
    fname = _drop_from_its_file(path, name)
    assert re.fullmatch(r"model-0000\d-of-00003\.safetensors", fname)
    leaf = {
        "model.layers.1.mlp.up_proj.weight": r"'model/layers/1/mlp/up_proj/kernel' \(16, 24\) float32",
        "model.norm.weight": r"'model/norm/weight' \(16,\) float32",
    }[name]
    shape = re.escape(str(tensors[name].shape))
    with pytest.raises(ValueError) as e:
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    msg = str(e.value)
    assert re.search(rf"leaf {leaf} <- tensor {re.escape(repr(name))}", msg), msg
    assert re.search(
        rf"the index \S*/{re.escape(files.INDEX)} names this tensor \(the leaf needs it as {shape}\) in file "
        rf"\S*/{re.escape(fname)} but that file does not hold it: the index and the file disagree",
        msg,
    ), msg
    assert "no file of the checkpoint has this tensor" not in msg


def test_error_index_contradicts_its_file_stacked_layers(tmp_path):
    """A stacked leaf counts the layers the index names: the missing tensor is named, not a layer count."""
    from test_safetensors_tp import stacked_llama

    tensors = llama_tensors(3, layers=2)
    tree = stacked_llama(tensors)
    units = lambda path, leaf: "layers" if vj.plan_path(path).startswith("model/layers") else "rest"
    plan = vj.plan(shapes_of(tree), make_mesh(2), units=units, stacked=("layers",), granularity=vj.rows(1))
    path = write_checkpoint(tensors, tmp_path / "a", num_files=2)
    fname = _drop_from_its_file(path, "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(
        ValueError,
        match=rf"leaf 'model/layers/self_attn/k_proj/kernel' \(2, 16, 8\) float32 <- tensor "
        rf"'model.layers.1.self_attn.k_proj.weight': the index \S*{re.escape(files.INDEX)} names this tensor \(the "
        rf"leaf needs it as \(8, 16\)\) in file \S*/{re.escape(fname)} but that file does not hold it",
    ):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping(stacked=True))


@pytest.mark.parametrize("num_files", [1, 3])
def test_error_shape_mismatch_names_the_file(small, num_files):
    tensors, _, plan, tmp = small
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = np.zeros((16, 20), np.float32)
    path = write_checkpoint(tensors, tmp / "a", num_files=num_files)
    if num_files == 1:
        fname = files.SINGLE
    else:
        with open(os.path.join(path, files.INDEX)) as f:
            fname = json.load(f)["weight_map"][name]
        assert re.fullmatch(r"model-0000\d-of-00003\.safetensors", fname)
    with pytest.raises(
        ValueError,
        match=rf"leaf 'model/layers/0/mlp/down_proj/kernel' \(24, 16\) float32 <- tensor '{re.escape(name)}': shape "
        rf"mismatch: file \S*/{re.escape(fname)} holds \(16, 20\) float32, the leaf needs \(16, 24\)",
    ):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())


def test_error_malformed_header(small):
    tensors, _, plan, tmp = small
    path = write_checkpoint(tensors, tmp / "a", num_files=1)
    file = os.path.join(path, "model.safetensors")
    data = bytearray(open(file, "rb").read())
    data[8:20] = b"{not json!!!"
    open(file, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors: malformed safetensors header"):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    open(file, "wb").write(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match=r"malformed safetensors header: length 1000000"):
        vj.checkpoint.load_safetensors(file, plan, mapping=llama_mapping())


def test_error_op_that_cannot_give_the_leaf_names_it_and_the_fix(tmp_path):
    t = {"qkv.weight": np.zeros((24, 8), np.float32)}
    path = write_checkpoint(t, tmp_path / "a", num_files=1)
    tree = {"attn": {"q": np.zeros((2, 4, 8), np.float32)}}
    plan = vj.plan(shapes_of(tree), make_mesh(2))
    mapping = Mapping((Entry("attn/q", "qkv.weight", (Split(0, 0, 3), SplitDim(0, (3, -1)))),))
    with pytest.raises(
        ValueError,
        match=r"leaf 'attn/q' \(2, 4, 8\).*'qkv.weight'.*SplitDim\(axis=0, sizes=\(3, -1\)\).*fix the entry's ops",
    ):
        vj.checkpoint.load_safetensors(path, plan, mapping=mapping)


def test_error_truncated_file_names_the_tensor(tmp_path, small):
    tensors, _, plan, _ = small
    path = write_checkpoint(tensors, tmp_path / "a", num_files=1)
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[:-4])  # the last tensor's last element gone
    with pytest.raises(ValueError, match=r"malformed safetensors header entry for tensor .*truncated.*copy it again"):
        vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    # a file that shrinks after its header was read: the read names the tensor and the bytes
    reader = files.Reader()
    at = len(data) - 54
    with pytest.raises(
        ValueError, match=rf"truncated: tensor 'model.norm.weight' needs bytes \[{at}, {at + 100}\) but"
    ):
        reader.read_into(file, at, memoryview(bytearray(100)), what="model.norm.weight")
    reader.close()


def test_error_save_of_a_fused_tensor_missing_parts(tmp_path):
    tree = {"attn": {"q": np.zeros((8, 8), np.float32), "k": np.zeros((8, 8), np.float32)}}
    plan = vj.plan(shapes_of(tree), make_mesh(2))
    mapping = Mapping(tuple(Entry(f"attn/{x}", "c_attn.weight", (Split(1, j, 3),)) for j, x in enumerate("qk")))
    with pytest.raises(ValueError, match=r"tensor 'c_attn.weight' \(8, 24\) is fused from 3 parts.*only 2.*map every"):
        vj.checkpoint.save_safetensors(vj.shard(tree, plan), tmp_path / "o", mapping=mapping)
