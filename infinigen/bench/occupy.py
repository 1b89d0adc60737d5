"""``bench --gpu-memory-gb N``: a card of N GB on a larger one. A second process holds all of the device
but N GB in one plain allocation before this process touches the device, so that every free-memory
query here (ours, PyTorch's, transformers') sees what a card of N GB would show: N GB less this
process's own CUDA context. It holds until this process ends or ``release`` is called."""

from __future__ import annotations

import subprocess
import sys

from infinigen.errors import InfinigenError

_HOLDER = """
import sys, torch
device, usable = torch.device(sys.argv[1]), int(sys.argv[2])
free = torch.cuda.mem_get_info(device)[0]
if free <= usable:
    print(f"only {free / 1e9:.2f} GB free", flush=True)
    sys.exit(1)
held = torch.empty(free - usable, dtype=torch.uint8, device=device)
print(f"held {held.numel()}", flush=True)
sys.stdin.read()  # until the benchmark ends (its end closes this pipe)
"""


class Occupier:
    def __init__(self, gpu_memory_gb: float, device: str) -> None:
        usable = int(gpu_memory_gb * 1e9)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, device, str(usable)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline().strip()
        if not line.startswith("held "):
            self.release()
            raise InfinigenError(f"--gpu-memory-gb {gpu_memory_gb:g}: cannot leave that much of {device}: {line}")
        self.held_bytes = int(line.split()[1])

    def release(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
