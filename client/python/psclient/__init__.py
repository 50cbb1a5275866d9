"""psclient: psd's worker client for Python (numpy; PyTorch in psclient.torch).

    import numpy as np, psclient
    with psclient.Client("127.0.0.1", 7070, worker_name="w0") as c:
        w = np.zeros(10, np.float32)
        c.create_variable("w", w)                   # create-or-get
        step = c.pull("w", w)                       # writes into w, no copy
        out = c.push(step, {"w": grad}, wait_token=True, pull_after={"w": w})
        step = out.token

A thin binding of libpsclient (psclient._core): every call blocks until the daemon answers,
with the GIL released; errors raise psclient.Error subclasses (one per psd status code).
Arrays are used in place: C-contiguous float32/float64/float16 numpy arrays (or anything with
the buffer protocol); bfloat16 and CUDA memory through psclient.RawTensor. See README "Python".
"""
import importlib.util as _importlib_util
import os as _os
import sys as _sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

# PyTorch, where it is installed, is loaded before the extension: with PyTorch 2.11's wheel
# (Python 3.12) and this extension built with pybind11 3.1, `import torch` after the extension
# had been loaded crashed the interpreter (README "Python": the GPU machine of 2026-11-30); in this
# order both load. It costs PyTorch's import time where PyTorch is installed and not imported yet;
# PSCLIENT_TORCH_FIRST=0 skips it (for numpy-only programs that never import torch).
if (_os.environ.get("PSCLIENT_TORCH_FIRST", "1") != "0" and "torch" not in _sys.modules
        and _importlib_util.find_spec("torch") is not None):
    try:
        import torch as _torch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken PyTorch is not psclient's to report
        pass

from ._errors import (Aborted, AlreadyExists, Cancelled, DeadlineExceeded, Error, FailedPrecondition, Internal,
                      InvalidArgument, NotFound, OutOfRange, ResourceExhausted, Unauthenticated, Unavailable,
                      Unimplemented, ERRORS, error_for)
from ._core import (Client, ColocationScope, JobConfig, JobStatus, LaunchEnvironment, PlacementMap, PushOutcome,
                    PushResult, RawTensor, ReduceResult, SlicePart, VariableInfo, VariablePlacement, code_name,
                    dtype_size, parse_cluster_list, read_launch_environment)

__version__ = "0.1.0"

#: psd's dtype names (psd::DTypeName); numpy arrays map float32/float64/float16 to them.
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass
class SparseGradient:
    """IndexedSlices for Client.push(sparse=[...]): rows `indices` of variable `name` get `values`
    ([len(indices), row dims...]). Indices may repeat and come in any order (summed before sending)."""
    name: str
    indices: Any  # a sequence or an int64/int32 array
    values: Any   # a C-contiguous array (or RawTensor)
    dense_shape: Optional[Sequence[int]] = None


__all__ = [
    "Client", "RawTensor", "SparseGradient", "read_launch_environment", "parse_cluster_list", "code_name",
    "dtype_size", "DTYPES", "JobConfig", "JobStatus", "LaunchEnvironment", "PlacementMap", "PushOutcome",
    "PushResult", "ReduceResult", "SlicePart", "VariableInfo", "VariablePlacement", "ColocationScope",
    "Error", "ERRORS", "error_for", "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition",
    "DeadlineExceeded", "Unavailable", "Cancelled", "OutOfRange", "ResourceExhausted", "Internal", "Unimplemented",
    "Unauthenticated", "Aborted",
]
