"""A worker for the etcd rendezvous test (tests/e2e/test_etcd_rendezvous_e2e.py): every
attempt joins a gloo process group; in the first attempt rank 1 waits until $GO_FILE exists
(the test creates it once it has killed an etcd member) and exits with status 3, so the
agent must re-form through the surviving members; the second attempt finishes."""
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=600))
dist.barrier()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
warm = " (warm)" if os.environ.get("MEGALITE_WARM_WORKER") else ""
print(f"rank {dist.get_rank()} attempt {attempt} up{warm}", flush=True)
if attempt == 0 and dist.get_rank() == 1:
    while not os.path.exists(os.environ["GO_FILE"]):
        time.sleep(0.05)
    os._exit(3)
dist.barrier()
print(f"rank {dist.get_rank()} attempt {attempt} done", flush=True)
