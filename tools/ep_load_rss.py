"""Peak host memory of loading a checkpoint onto an expert-parallel mesh (docs/scaling.md, "Loading under EP").

    PYTHONPATH=. python3 tools/ep_load_rss.py [--experts 128] [--moe-inter 1024] [--ep 4] [--dir DIR]

Writes a checkpoint of the embedded tiny configuration with more and wider routed experts (random MXFP4 codes from
``random_codes``, one tensor per expert as ``dijax convert`` writes them), then loads it in fresh processes on
``ep`` CPU host devices, each reporting its resident set before loading (VmRSS), its peak while loading (VmHWM,
reset first through /proc/self/clear_refs) and the bytes its loaded arrays hold:

  * sharded: ``load_params(cfg, path, mesh=make_mesh(ep, E))``, each device reading only its share;
  * place:   ``place_params(load_params(cfg, path), mesh)``, what the engine did before (the whole model on one
             device, then resharded).

On CPU host devices the devices' memory is the host's, so the loaded arrays themselves count in the RSS (the
experts once, split; replicated tensors once per device), and what a loader holds beyond its result is
``staging = peak - before - loaded``; on an accelerator the RSS's growth is all staging. Staging is the figure to
compare with the checkpoint's expert bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402,F401  (sets XLA flags before JAX starts)
import numpy as np  # noqa: E402

from dijax.io.loader import ASSETS  # noqa: E402

_SAFETENSORS_DTYPE = {"uint8": "U8", "float8_e4m3fn": "F8_E4M3", "bfloat16": "BF16", "float32": "F32"}


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_checkpoint(folder: str, experts: int, moe_inter: int, seed: int = 0) -> int:
    """Write the config and one safetensors file into ``folder``; returns the routed experts' bytes."""
    from dijax.config import ModelConfig
    from dijax.io.convert import Output, write_shard
    from dijax.io.random_init import random_codes

    with open(os.path.join(ASSETS, "config.json")) as f:
        config = json.load(f)
    config["text_config"].update(n_routed_experts=experts, moe_intermediate_size=moe_inter)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = ModelConfig.from_file(folder)
    outputs, expert_bytes = [], 0
    for name, value in random_codes(cfg, seed):
        value = np.asarray(value)
        parts = name.split(".")
        stacked = parts[2:4] == ["ffn", "experts"]
        pieces = ([(".".join(parts[:4] + [str(e)] + parts[4:]), value[e]) for e in range(len(value))] if stacked
                  else [(name, value)])
        for piece_name, piece in pieces:
            outputs.append(Output(piece_name, _SAFETENSORS_DTYPE[piece.dtype.name], piece.shape, piece.nbytes,
                                  piece.tobytes))
            expert_bytes += piece.nbytes if stacked else 0

    write_shard(os.path.join(folder, "model.safetensors"), outputs)
    return expert_bytes


def measure(mode: str, folder: str, ep: int) -> dict:
    """Load ``folder`` by ``mode`` in this process (``ep`` host devices) and report its memory figures."""
    from dijax.parallel.mesh import force_host_devices

    force_host_devices(ep)
    import jax
    import jax.numpy as jnp

    from dijax.config import ModelConfig
    from dijax.io.checkpoint import load_params
    from dijax.parallel.mesh import make_mesh, place_params

    jnp.zeros(1).block_until_ready()  # the backend and its devices up before the baseline
    cfg = ModelConfig.from_file(folder)
    mesh = make_mesh(ep, cfg.n_routed_experts)
    path = os.path.join(folder, "model.safetensors")
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    if mode == "sharded":
        params = load_params(cfg, path, mesh=mesh)
    else:
        params = place_params(load_params(cfg, path), mesh)
    jax.block_until_ready(params)
    loaded = sum(shard.data.nbytes for leaf in jax.tree.leaves(params) for shard in leaf.addressable_shards)
    peak = _status("VmHWM")
    on_host = jax.devices()[0].platform == "cpu"
    return {"mode": mode, "platform": jax.devices()[0].platform, "before": before, "peak": peak,
            "after": _status("VmRSS"), "loaded": loaded, "staging": peak - before - (loaded if on_host else 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    parser.add_argument("--moe-inter", type=int, default=1024, help="expert width (moe_intermediate_size)")
    parser.add_argument("--ep", type=int, default=4, help="host devices = expert-parallel ranks")
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--measure", choices=("sharded", "place"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir, args.ep)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(args.dir or tmp, "ep-rss-model")
        expert_bytes = write_checkpoint(folder, args.experts, args.moe_inter)
        total = os.path.getsize(os.path.join(folder, "model.safetensors"))
        print(f"checkpoint {total / 1e6:.1f} MB, routed experts {expert_bytes / 1e6:.1f} MB "
              f"({args.experts} experts of width {args.moe_inter}, 9 layers); ep={args.ep}")
        for mode in ("sharded", "place"):
            done = subprocess.run([sys.executable, __file__, "--measure", mode, "--dir", folder, "--ep", str(args.ep)],
                                  capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{mode:8s} {r['platform']} before {r['before'] / 1e6:7.1f} MB  peak {r['peak'] / 1e6:7.1f} MB  "
                  f"after {r['after'] / 1e6:7.1f} MB  growth {(r['peak'] - r['before']) / 1e6:7.1f} MB  "
                  f"loaded arrays {r['loaded'] / 1e6:7.1f} MB  staging {r['staging'] / 1e6:7.1f} MB = "
                  f"{r['staging'] / expert_bytes:.3f} x expert bytes")


if __name__ == "__main__":
    main()
