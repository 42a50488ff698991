"""flashtile: exact FlashAttention for PyTorch, in Triton kernels, with an O(N)-memory CPU path."""

from . import reference
from .decode import flash_attn_with_kvcache
from .interface import (
    attention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .merge import flash_attn_combine, merge_attention_states, merge_split_attention_states
from .ops import backend

__all__ = [
    "attention",
    "backend",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "merge_split_attention_states",
    "reference",
]
__version__ = "0.1.0"
