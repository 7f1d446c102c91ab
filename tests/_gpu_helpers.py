"""What the GPU suite shares: whether a device is here, and the skip mark for when it is not."""

from __future__ import annotations

import pytest
from graphir.backends.gpu.device import available

HAS_GPU = available()
gpu_only = pytest.mark.skipif(not HAS_GPU, reason="no GPU here: CuPy sees no CUDA/HIP device")
