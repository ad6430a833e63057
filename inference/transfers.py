"""Moving a step's small tensors between host and device without stalling the device stream.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the whole
stream; `.tolist()` of a CUDA tensor waits for the whole stream too. Harmless while the GPU is
idle, but once the next step is already queued behind the current one (async scheduling,
`inference/scheduling/async_scheduling.py`) each such wait would also wait for that next step. Here host
memory is pinned, copies are `non_blocking`, and a CUDA event says when each copy is done:

* `StagingBuffers`: reusable pinned byte buffers, taken in turn, for the packed step inputs
  (`inference/runner/step_inputs.py`); a buffer is rewritten only once the copy out of it has finished.
* `to_device`: a short list of numbers as a device tensor (sampling parameters).
* `HostCopy`: device tensors copied into pinned host memory, read once their event has fired.

On CPU the same calls work on ordinary memory, with no events.
"""

from __future__ import annotations

import numpy as np
import torch


class _Staging:
    def __init__(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self.event: torch.cuda.Event | None = None  # recorded after the last copy out of it


class StagingBuffers:
    """`count` host byte buffers used in turn (pinned on CUDA), each sent to `device` with one copy.

    With two buffers, filling one while the copy out of the other may still be queued never
    waits in practice: a buffer comes round again two steps later, after the engine has read
    that step's tokens (which come after its input copy on the same stream).
    """

    def __init__(self, device: torch.device, count: int = 2, capacity: int = 1 << 16):
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers = [_Staging() for _ in range(count)]
        self._turn = 0
        self._taken: _Staging | None = None
        self._capacity = capacity

    def take(self, nbytes: int) -> np.ndarray:
        """The next buffer's first `nbytes` bytes as a writable uint8 array (contents undefined)."""
        buf = self._buffers[self._turn]
        self._turn = (self._turn + 1) % len(self._buffers)
        if buf.event is not None and not buf.event.query():
            buf.event.synchronize()  # the copy out of it (a step or more ago) must have finished
        if buf.tensor.numel() < nbytes:
            size = max(nbytes, 2 * buf.tensor.numel(), self._capacity)
            buf.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            buf.array = buf.tensor.numpy()
        self._taken = buf
        return buf.array[:nbytes]

    def send(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the buffer last taken, on the device: [nbytes] uint8. On CUDA the
        copy is queued on the current stream (non-blocking); on CPU it is a private copy."""
        buf = self._taken
        host = buf.tensor[:nbytes]
        if not self.pinned:
            return host.clone()  # the buffer is rewritten later: nothing may keep pointing into it
        device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        device_bytes.copy_(host, non_blocking=True)
        if buf.event is None:
            buf.event = torch.cuda.Event()
        buf.event.record(torch.cuda.current_stream(self.device))
        return device_bytes


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` that does not wait for the stream on
    CUDA (pinned source, non-blocking copy; the pinned block is not reused before the copy ran)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host; `get()` waits for these copies only (not for
    work queued after them), then returns the host tensors in the given order."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self.host = list(tensors)
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self.host, tensors):
            host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(tensors[0].device))

    def get(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host
