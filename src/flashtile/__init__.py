"""flashtile: exact FlashAttention for PyTorch, in Triton kernels, with an O(N)-memory CPU path."""

from . import reference
from .interface import attention, flash_attn_func

__all__ = ["attention", "flash_attn_func", "reference"]
__version__ = "0.1.0"
