"""dijax: DeepSeek-V4.1-Flash inference in JAX.

The model rounds to bf16 at exactly the points DeepSeek's reference does, so XLA must not keep excess precision
in fused bf16 computations: ``--xla_allow_excess_precision=false`` is added to ``XLA_FLAGS`` here, before JAX
initialises its backends. Import dijax before running any JAX computation.
"""

import os as _os

_FLAG = "--xla_allow_excess_precision=false"
if _FLAG not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

__version__ = "0.1.0"


def __getattr__(name: str):
    """Public API, imported lazily so that ``import dijax`` stays cheap and sets XLA flags first."""
    if name == "LLM":
        from dijax.runtime.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput"):
        from dijax import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'dijax' has no attribute {name!r}")
