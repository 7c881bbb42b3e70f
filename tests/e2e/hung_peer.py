"""Run under torchrun with 2 processes: rank 1 stops itself (SIGSTOP, a hung peer), rank 0
runs one collective on the TP group and one receive on the PP group; each must fail within
--distributed-timeout-minutes with an error naming the group, the op and the peer.  Rank 0
prints one line per error, then kills rank 1."""
import faulthandler
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megalite import comm
from megalite.cli.arguments import parse_args
from megalite.parallel_state import initialize

LAYOUT = sys.argv[1]          # "tp" or "pp"
cfg = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--seq-length", "16", "--vocab-size", "100", "--mock-data", "--lr", "1e-3",
                  "--train-iters", "1", f"--{'tensor' if LAYOUT == 'tp' else 'pipeline'}"
                  "-model-parallel-size", "2", "--distributed-timeout-minutes", "0.1"])
faulthandler.dump_traceback_later(60, exit=True)   # never hang the test suite
state = initialize(cfg)
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(1.0)
t0 = time.monotonic()
try:
    if LAYOUT == "tp":
        comm.all_reduce(torch.ones(4), state.tp)
    else:
        comm.batch_send_recv([], [(torch.empty(4), 1)], state.pp)
    print("NO ERROR", flush=True)
except comm.CommError as exc:
    print(f"ERROR after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
os.kill(pids[1], signal.SIGKILL)
os._exit(0)
