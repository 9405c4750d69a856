"""Storage formats, the graph-level quantize/dequantize ops, and the lowerings of a rewritten step."""
