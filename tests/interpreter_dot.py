"""Triton's interpreter with its `tl.dot` taken a row of the tile at a time.

The interpreter computes `tl.dot` with numpy's matmul, that is with the BLAS numpy carries. On some
CPUs that BLAS gives a row of the product low bits that depend on where the row sits in the tile
(OpenBLAS's Haswell kernels, which it also picks on AMD's Zen: rows 6 to 11 of 12 sum in another
order than rows 0 to 5), where a GPU's tensor cores compute every row of a tile alike. The
batch-invariance tests ask whether *our* kernels' tiling and reduction order keep a row's result
independent of its batch; with this dot, every row's products are one vector-matrix product of
the same shapes wherever the row sits, so a difference they find is our kernels', not the BLAS's.
"""
from __future__ import annotations

import numpy as np


def rowwise_dot():
    """Replace the interpreter's dot (in this process) by the same product taken row by row;
    returns a function that puts the interpreter's own back."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    blas_dot = InterpreterBuilder.create_dot
    if getattr(blas_dot, "rowwise", False):
        return lambda: None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:  # (FP8 operands: the interpreter's own)
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.empty((a.data.shape[0], b.data.shape[1]), dtype=d.data.dtype)
        for i in range(a.data.shape[0]):
            out[i] = np.matmul(np.ascontiguousarray(a.data[i]), b.data, dtype=d.data.dtype)
        return TensorHandle(out + d.data, d.dtype.scalar)

    create_dot.rowwise = True
    InterpreterBuilder.create_dot = create_dot

    def restore() -> None:
        InterpreterBuilder.create_dot = blas_dot

    return restore
