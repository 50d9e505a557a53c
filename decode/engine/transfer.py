"""Host <-> device copies that never wait for the GPU queue."""
from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # array: any host array -> the same values on device, without a host synchronization.
    # A pageable host->device copy waits for the GPU queue to drain; a pinned one with
    # non_blocking does not, and the caching host allocator keeps the pinned block alive until
    # the copy has run.
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host if torch.device(device).type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def record_event(device: torch.device) -> torch.cuda.Event:
    """An event on the device's current stream, recorded after the copies queued so far."""
    with torch.cuda.device(device):
        event = torch.cuda.Event()
        event.record()
    return event


def wait_for(event: torch.cuda.Event) -> None:
    """Block until `event` has run; a query first, so that the usual case (long done, a step's
    sync came between) makes no synchronizing call at all."""
    if not event.query():
        event.synchronize()
