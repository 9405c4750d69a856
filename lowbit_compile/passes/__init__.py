"""FX passes from a stock optimizer's step to the rewritten step: trace, roles, quantize-states, split."""
