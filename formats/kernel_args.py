"""Arrays as ktc's compiled kernels receive them.

Numba compiles a function once for each combination of argument types, and a read-only array is
a type apart from a writable one of the same dtype and shape. Weights mapped from a bundle or a
checkpoint are read-only; the same weights made in memory (a bf16 source decoded to float32
before quantizing, a calibration's probe matrices, an array a caller builds) are writable. A
kernel reached both ways was compiled twice: 2 to 15 s each for the larger kernels on two cores,
paid again after every change to the sources (the cache is per version). So the Python functions
that hand arrays to compiled code give each argument one of the two: weights ``read_only``,
activations ``writable`` (what a compiled decode step makes itself and hands on). Numba has no
option to type one as the other, and outputs must stay writable, so this is done argument by
argument at those entry points.
"""

from __future__ import annotations

import numpy as np


def read_only(array: np.ndarray) -> np.ndarray:
    """``array`` itself when it is read-only, else a read-only view of it (no copy)."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def writable(array: np.ndarray) -> np.ndarray:
    """``array`` itself when it is writable, else a copy (activations: small)."""
    return array if array.flags.writeable else array.copy()
