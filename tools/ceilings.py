"""The ceilings a benchmark's floor is measured against, by the device it runs on.

Each is what this workplace measured on one machine of that kind (the device tool's KINDS.md): a device-to-device
copy (bytes read and written) and an 8192 x 8192 x 8192 bf16 matrix product on random data. A device of no kind
listed here gets the H200's, and the benchmark's header says so.
"""

from __future__ import annotations

from typing import NamedTuple


class Ceilings(NamedTuple):
    """bandwidth: bytes/s; flops: bf16 matrix FLOP/s; source: where they were measured."""

    bandwidth: float
    flops: float
    source: str


MEASURED = {  # a substring of jax's device_kind -> its ceilings; the first that matches wins
    "H200": Ceilings(4.3e12, 7.9e14, "H200, measured 2026-10-28"),
    "H100": Ceilings(3.0e12, 7.98e14, "H100 80GB HBM3, measured 2026-11-13"),
}
FALLBACK = "H200"


def ceilings(device_kind: str) -> Ceilings:
    """The measured ceilings of the device ``device_kind`` names (e.g. 'NVIDIA H100 80GB HBM3'), else the
    H200's with a source saying they were not measured there."""
    for name, measured in MEASURED.items():
        if name in device_kind:
            return measured
    fallback = MEASURED[FALLBACK]
    return fallback._replace(source=f"{fallback.source}; none measured for {device_kind!r}")
