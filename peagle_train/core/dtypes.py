"""The one home of dtype rules: the float32 promotion of half types, and the safetensors dtype table.

* :func:`acc_dtype` is the accumulation rule every numerically sensitive step follows (softmax and
  log-sum-exp of attention, RMSNorm, the loss and its weights, the decoding loop's probabilities):
  half types (bf16, fp16) are computed in float32, float32 stays float32 and float64 stays float64,
  so the float64 exactness tests stay exact while bf16 training accumulates in float32
  (``torch.promote_types(dtype, torch.float32)``).
* :data:`SAFETENSORS_DTYPES` maps a safetensors header dtype code (``"BF16"``, ``"F8_E4M3"``, ...;
  safetensors format specification, ``Dtype``) to its torch dtype; :func:`safetensors_name` and
  :func:`safetensors_itemsize` read it; :data:`FLOAT_EXPORT_DTYPES` are the floating dtypes an
  export may hold, :func:`dtype_name` the name ``config.json`` writes for them (``"bfloat16"``).
"""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of ``dtype``: float32 for half types, else ``dtype`` (float64 stays float64).

    Example: ``acc_dtype(torch.bfloat16) == torch.float32``; ``acc_dtype(torch.float64) == torch.float64``.
    """
    return torch.promote_types(dtype, torch.float32)


#: safetensors header dtype code → torch dtype (the codes this project reads or writes).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16,
    "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
}

#: safetensors codes of the floating dtypes an export's weights may have (vLLM casts them to the serving dtype).
FLOAT_EXPORT_DTYPES = ("BF16", "F16", "F32")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling of ``config.json``'s ``torch_dtype``)."""
    return str(dtype).removeprefix("torch.")


def safetensors_name(code: str) -> str:
    """A safetensors dtype code as a torch dtype name (``"BF16"`` → ``"bfloat16"``); an unknown code is
    returned as given (error messages show what the file holds)."""
    return dtype_name(SAFETENSORS_DTYPES[code]) if code in SAFETENSORS_DTYPES else code


def safetensors_itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code.

    Raises:
        KeyError: a code not in :data:`SAFETENSORS_DTYPES`.
    """
    return SAFETENSORS_DTYPES[code].itemsize
