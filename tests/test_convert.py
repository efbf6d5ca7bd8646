"""`dijax convert`: streaming, bit-exact, validated, atomic; every bad input has a message naming the problem."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dijax.io.safetensors import SafetensorsFile
from dijax.config import ModelConfig
from dijax.io.convert import ConversionError, Output, convert, write_shard
from dijax.io.tensor_spec import backbone_spec
from tests.conftest import parity_path


def _hf_tensors(hf_dir: str) -> dict[str, tuple[str, tuple, bytes]]:
    out = {}
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    for file in files:
        st = SafetensorsFile(os.path.join(hf_dir, file))
        for name, info in st.header.items():
            out[name] = (info["dtype"], tuple(info["shape"]), st.get(name).tobytes())
    return out


def _write_hf(folder, tensors: dict, shards: int = 3, config: dict | None = None, drop_index_file: str | None = None):
    """Write ``tensors`` as an HF-style sharded checkpoint with an index json and config."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        outs = [Output(n, tensors[n][0], tensors[n][1], len(tensors[n][2]), lambda b=tensors[n][2]: b)
                for n in group]
        write_shard(os.path.join(folder, file), outs)
        weight_map.update({n: file for n in group})
    if drop_index_file:
        weight_map[names[0]] = drop_index_file
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config or json.load(open(parity_path("tiny", "config.json"))), f)
    shutil.copy(parity_path("tiny", "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_hf():
    return _hf_tensors(parity_path("tiny", "hf"))


def test_multi_shard_round_trip_is_bit_exact(tmp_path, tiny_hf):
    src = _write_hf(tmp_path / "hf", tiny_hf, shards=5)
    out = convert(src, str(tmp_path / "out"), max_shard_bytes=1 << 20, progress=False)
    files = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert len(files) > 3
    ref = SafetensorsFile(parity_path("tiny", "reference", "model.safetensors"))
    got = {}
    for file in files:
        st = SafetensorsFile(os.path.join(out, file))
        got.update({n: st.get(n) for n in st.names()})
    assert set(got) == set(ref.names())  # wo_a scales dropped, nothing else lost or added
    for name in ref.names():  # identical bytes (experts: the same packed bytes, F4 vs U8 container)
        assert got[name].tobytes() == ref.get(name).tobytes(), name
    for name in ("config.json", "tokenizer.json", "dijax.json", "model.safetensors.index.json"):
        assert os.path.exists(os.path.join(out, name))


def _fails(tmp_path, tensors, match, **kwargs):
    src = _write_hf(tmp_path / "hf", tensors, **kwargs)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        convert(src, str(out), progress=False)
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # nothing half-written is left behind


def test_missing_tensor(tmp_path, tiny_hf):
    tensors = dict(tiny_hf)
    del tensors["layers.3.attn.wq_b.scale"]
    _fails(tmp_path, tensors, r"missing, e\.g\. \['layers\.3\.attn\.wq_b\.scale'\]")


def test_unexpected_tensor(tmp_path, tiny_hf):
    tensors = dict(tiny_hf)
    tensors["layers.0.ffn.experts.8.w1.scale"] = tiny_hf["layers.0.ffn.experts.7.w1.scale"]
    _fails(tmp_path, tensors, r"does not explain.*layers\.0\.ffn\.experts\.8\.w1\.scale")


def test_wrong_shape_and_dtype(tmp_path, tiny_hf):
    tensors = dict(tiny_hf)
    tensors["layers.0.attn.attn_sink"] = ("F32", (5,), b"\0" * 20)
    _fails(tmp_path, tensors, r"'layers\.0\.attn\.attn_sink' \(attention sink\) has shape \[5\], expected \[4\]")
    shutil.rmtree(tmp_path / "hf")
    tensors = dict(tiny_hf)
    tensors["layers.0.attn.attn_sink"] = ("BF16", (4,), b"\0" * 8)
    _fails(tmp_path, tensors, r"attn_sink' \(attention sink\) has dtype BF16, expected F32")


def test_mxfp4_scale_read_as_nvfp4_is_rejected(tmp_path, tiny_hf):
    tensors = dict(tiny_hf)
    name = "layers.2.ffn.experts.5.w1.scale"
    dtype, shape, _ = tiny_hf[name]
    wrong = (shape[0], shape[1] * 2)  # one scale per 16 elements: the packed shape misread as the block
    tensors[name] = (dtype, wrong, b"\x7f" * (wrong[0] * wrong[1]))
    _fails(tmp_path, tensors, r"expected \[128, 8\]; MXFP4 scales cover blocks of 32 elements.*NVFP4")


def test_truncated_and_corrupt_shards(tmp_path, tiny_hf):
    src = _write_hf(tmp_path / "hf", tiny_hf)
    shard = os.path.join(src, "model-00002-of-00003.safetensors")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-1000])
    with pytest.raises(ConversionError, match=r"shard model-00002-of-00003\.safetensors is truncated"):
        convert(src, str(tmp_path / "out"), progress=False)
    open(shard, "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ConversionError, match=r"shard model-00002-of-00003\.safetensors: unreadable"):
        convert(src, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_index_naming_a_missing_file(tmp_path, tiny_hf):
    _fails(tmp_path, tiny_hf, r"names shard 'model-00009-of-00009\.safetensors', which does not exist",
           drop_index_file="model-00009-of-00009.safetensors")


def test_config_that_disagrees_with_the_tensors(tmp_path, tiny_hf):
    config = json.load(open(parity_path("tiny", "config.json")))
    config["text_config"]["n_routed_experts"] = 4
    _fails(tmp_path, tiny_hf, r"does not explain.*n_routed_experts=4", config=config)
    shutil.rmtree(tmp_path / "hf")
    config = json.load(open(parity_path("tiny", "config.json")))
    config["text_config"]["num_hidden_layers"] = 8
    config["text_config"]["compress_ratios"] = config["text_config"]["compress_ratios"][:8] + [0]
    config["text_config"]["dspark_target_layer_ids"] = [5, 6, 7]
    _fails(tmp_path, tiny_hf, r"does not explain.*layers\.8\..*n_layers=8", config=config)
    shutil.rmtree(tmp_path / "hf")
    config = json.load(open(parity_path("tiny", "config.json")))
    config["text_config"]["compress_ratios"] = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0]  # layer 2 would have no wgate
    _fails(tmp_path, tiny_hf, r"does not explain.*layers\.2\.attn\.compressor\.wgate\.weight", config=config)


def test_existing_output_and_bad_expert_dtype(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="already exists"):
        convert(parity_path("tiny", "hf"), str(tmp_path / "out"), progress=False)
    with pytest.raises(ConversionError, match=r"--expert-dtype must be 'fp4' or 'fp8', got 'nvfp4'"):
        convert(parity_path("tiny", "hf"), str(tmp_path / "new"), expert_dtype="nvfp4", progress=False)


# `dijax convert` then `dijax parity` on its output: tests/test_parity_tiny.py (it reuses that file's compiled steps)


_RSS_CHILD = """
import sys
from dijax.io.convert import convert
if sys.argv[1] == "convert":
    convert(sys.argv[2], sys.argv[3], progress=False)
# VmHWM: peak resident set of this process image (ru_maxrss would carry the parent's peak across exec)
print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """A generated 9-layer checkpoint of ~250 MB converts within (import baseline + a few largest tensors)."""
    raw = json.load(open(parity_path("tiny", "config.json")))
    raw["text_config"].update(vocab_size=32768, n_routed_experts=128, moe_intermediate_size=512)
    cfg = ModelConfig.from_dict(raw)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, spec in backbone_spec(cfg).items():
        count = int(np.prod(spec.shape))
        size = {"F32": 4, "BF16": 2}.get(spec.dtypes[0], 1) * count
        dtype = spec.dtypes[0]
        data = rng.integers(0, 120, size, dtype=np.uint8).tobytes()  # valid fp8/e8m0/bf16 bit patterns
        tensors[name] = (dtype, spec.shape, data)
    total = sum(len(t[2]) for t in tensors.values())
    largest = max(len(t[2]) for t in tensors.values())
    src = _write_hf(tmp_path / "hf", tensors, shards=6, config=raw)
    del tensors
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    run = lambda *a: int(subprocess.run([sys.executable, "-c", _RSS_CHILD, *a], env=env, check=True,
                                        capture_output=True, text=True).stdout.split()[-1]) * 1024
    baseline = run("baseline")
    peak = run("convert", src, str(tmp_path / "out"))
    assert total > 200e6
    assert peak - baseline < 4 * largest + 48e6, (peak - baseline, largest, total)
