"""The storage of quantized states, below everything else in the package: the registry of element formats
(``registry.py``, the shipped ones in ``builtin.py``), a state's format and the reference encode and decode
(``element.py``), the dynamic map's tables (``dynamic.py``), block quantization with outlier patches
(``blockquant.py``), stochastic rounding's draws (``rounding.py``) and the master residual (``residual.py``).
"""

from __future__ import annotations

from . import builtin  # noqa: F401  (registers the shipped formats)
from .element import StateFormat, decode, domain_bound, encode, normalize, round_bf16, round_fp8, special_codes
from .registry import ElementFormat, element_format, format_names, passthrough, registered

__all__ = ["ElementFormat", "StateFormat", "decode", "domain_bound", "element_format", "encode", "format_names",
           "normalize", "passthrough", "registered", "round_bf16", "round_fp8", "special_codes"]
