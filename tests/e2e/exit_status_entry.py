"""A worker that fails with a chosen status (tests of the launchers' exit status).

Every rank joins a gloo process group; rank $FAIL_RANK (default 1) leaves with status
$FAIL_CODE (default 3) while the others wait in a barrier, which then fails for them as a
training collective would (status 1).  With FAIL_CODE=0 every rank finishes."""
import os
import sys
from datetime import timedelta

import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
dist.barrier()
code = int(os.environ.get("FAIL_CODE", "3"))
if code and dist.get_rank() == int(os.environ.get("FAIL_RANK", "1")):
    sys.stdout.flush()
    os._exit(code)
dist.barrier()
print(f"rank {dist.get_rank()} done", flush=True)
