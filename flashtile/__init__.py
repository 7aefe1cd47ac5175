"""flashtile: the FlashAttention family, complete, in Python."""

__version__ = "0.1.0"
