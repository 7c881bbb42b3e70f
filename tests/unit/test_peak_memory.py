"""The CPU peak-memory figure in the training log is this process's own, not its launcher's."""
import subprocess
import sys

import torch

from megalite.training.loop import peak_memory_bytes

CHILD = "from megalite.training.loop import peak_memory_bytes; print(peak_memory_bytes('cpu'))"


def test_peak_memory_counts_this_process():
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, written so it is resident
    assert peak_memory_bytes("cpu") >= 256 * 2**20
    del big


def test_child_does_not_report_its_parents_size():
    ballast = bytearray(1536 * 2**20)  # the parent holds 1.5 GiB when it starts the child
    ballast[::4096] = b"\1" * len(ballast[::4096])
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    child_peak = int(out.stdout.strip())
    assert 10 * 2**20 < child_peak < 1024 * 2**20, child_peak  # torch imported, no ballast
    del ballast
