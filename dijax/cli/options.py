"""Options shared by the commands that run the model (``generate``, ``parity``): the kernel choice and expert
parallelism."""

from __future__ import annotations

import argparse

from dijax.parallel.mesh import force_host_devices


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--kernels auto|on|off`` and ``--ep N``."""
    parser.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                        help="step kernels: the Pallas kernels (on, GPU only), the jnp references (off), or auto")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (a CPU-only host gets N devices)")


def apply_ep(args: argparse.Namespace) -> None:
    """Check ``--ep`` and, for ep > 1, give a CPU-only host that many devices. Call it before JAX initialises its
    backends (before the model is loaded)."""
    if args.ep < 1:
        raise ValueError(f"--ep must be a positive number of devices, got {args.ep}")
    if args.ep > 1:
        force_host_devices(args.ep)
