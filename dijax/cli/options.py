"""Options shared by the commands that run the model (``generate``, ``parity``): the kernel choice and expert
parallelism."""

from __future__ import annotations

import argparse

from dijax.kernels.options import parse_kernels
from dijax.parallel.mesh import force_host_devices


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--kernels`` (``add_kernels_option``) and ``--ep N``."""
    add_kernels_option(parser)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (a CPU-only host gets N devices)")


def add_kernels_option(parser: argparse.ArgumentParser) -> None:
    """``--kernels auto|on|off[,option=impl...]``, checked at parsing (``dijax.kernels.options.parse_kernels``)."""
    parser.add_argument("--kernels", type=kernels_argument, default="auto",
                        help="step kernels: the Pallas kernels (on, GPU only), the jnp references (off), or auto; "
                             "then optional overrides, e.g. off,sparse_attn_impl=pallas")


def kernels_argument(value: str) -> str:
    """argparse type of ``--kernels``: the value if ``dijax.kernels.options.parse_kernels`` accepts it."""
    try:
        parse_kernels(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def apply_ep(args: argparse.Namespace) -> None:
    """Check ``--ep`` and, for ep > 1, give a CPU-only host that many devices. Call it before JAX initialises its
    backends (before the model is loaded)."""
    if args.ep < 1:
        raise ValueError(f"--ep must be a positive number of devices, got {args.ep}")
    if args.ep > 1:
        force_host_devices(args.ep)
