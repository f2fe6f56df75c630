"""INT4 weight-only (W4A16) checkpoints: each release layout read into one in-memory form (`packed.Int4Linear`)."""

from .packed import Int4Linear, dequantize, pack_int4, quantize_rtn, unpack_int4

__all__ = ["Int4Linear", "dequantize", "pack_int4", "quantize_rtn", "unpack_int4"]
