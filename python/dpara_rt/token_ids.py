"""Token ids given as a torch tensor or a numpy array (what transformers' tokenizers return), as lists of ints."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["id_rows", "is_id_array"]


def is_id_array(value) -> bool:
    """Whether `value` is a torch tensor or a numpy array (of any dtype: id_rows checks it)."""
    return isinstance(value, (torch.Tensor, np.ndarray))


def id_rows(value, what: str = "prompts", batch: bool = True) -> list[list[int]]:
    """The rows of token ids in a tensor or array: 1-D is one row, 2-D (where `batch`) one row per line. Other
    dtypes than integers, other ranks and empty rows are refused in one line naming `what`."""
    if isinstance(value, torch.Tensor):
        dtype, shape, kind = value.dtype, tuple(value.shape), "a tensor"
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    elif isinstance(value, np.ndarray):
        dtype, shape, kind = value.dtype, value.shape, "an array"
        integer = dtype.kind in "iu"
    else:
        raise ValueError(f"{what} is a {type(value).__name__}; expected a torch tensor or numpy array of token ids")
    if not integer:
        raise ValueError(f"{what} is {kind} of dtype {dtype}; expected integer token ids (int64, int32, ...)")
    ranks = "[T] (one prompt) or [B, T] (a batch)" if batch else "[T]"
    if len(shape) not in ((1, 2) if batch else (1,)) or 0 in shape:
        raise ValueError(f"{what} is {kind} of shape {list(shape)}; expected {ranks} with T >= 1")
    rows = value.tolist() if isinstance(value, np.ndarray) else value.detach().cpu().tolist()
    return [rows] if len(shape) == 1 else rows
