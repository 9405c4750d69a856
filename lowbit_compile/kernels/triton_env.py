"""Whether Triton kernels built now run interpreted (``TRITON_INTERPRET=1``), asked without importing
triton: both the backend choice (``backends``) and the Triton lowering (``triton_backend``) read it."""

from __future__ import annotations

import os
import sys


def interpreting() -> bool:
    """Whether Triton kernels built now run interpreted (``TRITON_INTERPRET=1``); imports nothing."""
    knobs = getattr(sys.modules.get("triton"), "knobs", None)  # triton >= 3.4 reads the variable into knobs
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
