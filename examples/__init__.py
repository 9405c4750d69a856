"""Runnable CPU-sized training examples comparing fp32 and low-bit optimizer states."""
