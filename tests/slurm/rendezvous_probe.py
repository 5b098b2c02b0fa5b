"""An srun task that translates the SLURM variables and checks the rendezvous, without creating a process group.

Rank 0 only checks its port and exits: it never listens, so every other rank must give up with a clear error
after ZEROTRAIN_RENDEZVOUS_TIMEOUT seconds. An optional argument replaces MASTER_ADDR (a node name that does not
resolve). Exit 3 on RendezvousError, printing the message and how long the check took.
"""

import os
import sys
import time

from zerotrain.launch.rendezvous import RendezvousError, check_rendezvous
from zerotrain.launch.slurm import apply_slurm_env

apply_slurm_env()
if len(sys.argv) > 1:
    os.environ["MASTER_ADDR"] = sys.argv[1]
started = time.monotonic()
try:
    check_rendezvous()
except RendezvousError as e:
    print(f"FAILED after {time.monotonic() - started:.1f}s: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
print(f"rank {os.environ['RANK']}: rendezvous ok", flush=True)
