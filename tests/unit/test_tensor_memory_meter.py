"""The tensor-memory meter (torch's CPU allocator events through the profiler): the peak of
live tensor bytes inside a marked window, relative to the meter's start; blocks whose free
gloo's worker thread made unseen end at their address's reuse or with their collective."""
import torch

from megalite.training.tensor_memory_meter import TensorMemoryMeter, block_lifetimes

MB = 1_000_000


def test_window_peak_counts_temporaries_and_frees():
    before = torch.ones(MB // 4)                  # before the meter: not counted
    with TensorMemoryMeter() as meter:
        a = torch.ones(MB // 4)                    # 1 MB, before the window
        with meter.window("w"):
            b = torch.ones(2 * MB // 4)            # 2 MB
            c = b * 2                              # 2 MB more: 5 MB live
            del b, c
            d = torch.ones(MB // 8)                # 0.5 MB
        del a
    w = meter.result.windows["w"]
    assert w.start_bytes == MB
    assert 5 * MB <= w.peak_bytes <= 5 * MB + 64     # + the scalar 2 as a tensor
    assert w.end_bytes == MB + MB // 2
    assert not meter.active and not torch.autograd._profiler_enabled()
    del before, d


def test_backward_peak_holds_saved_activations():
    x = torch.randn(256, 256, requires_grad=True)
    with TensorMemoryMeter() as meter:
        with meter.window("fb"):
            h = torch.tanh(x @ x)                 # saved: tanh's output (256 KiB)
            loss = (h * h).sum()                  # saved: h twice (same storage)
            loss.backward()
    w = meter.result.windows["fb"]
    act = 256 * 256 * 4
    assert 2 * act <= w.peak_bytes - w.start_bytes <= 6 * act   # activations + grads in flight
    assert w.end_bytes - w.start_bytes >= act                   # x.grad stays


def test_unseen_frees_end_at_their_last_use():
    # (time, ptr, bytes, end of the enclosing c10d op or None)
    allocs = [(0, 0xA, 100, None), (1, 0xB, 50, 5),      # B: a collective's temporary
              (2, 0xA, -100, None),                      # A freed, seen
              (3, 0xC, 70, None),                        # C: never freed here
              (8, 0xC, 70, None),                        # C's address reused: freed before
              (9, 0xD, 30, 12),                          # D: dead at the end (gloo's temp)
              (10, 0xE, 40, None),                       # E: a collective's input, last used
              (20, 0xE, 40, None),                       # at 15, address reused at 20
              (21, 0xF, 60, None),                       # F: collective input, alive at stop
              (22, 0x1, 80, None)]                       # G: collective input, dead at stop
    uses = {0xE: [13, 15], 0xA: [1], 0xF: [23], 0x1: [24, 26]}
    lifetimes, stale = block_lifetimes(allocs, uses, {0xE, 0xF, 0x1}, live_ptrs={0xF})
    assert lifetimes == [(0, 2, 100), (1, 5, 50), (3, 8, 70), (8, None, 70), (9, 12, 30),
                         (10, 15, 40), (20, None, 40), (21, None, 60), (22, 26, 80)]
    assert stale == 5
