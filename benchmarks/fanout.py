"""Start N copies of a command with RANK/WORLD_SIZE set, wait for all: MPS "by hand" needs a launcher too.

python benchmarks/fanout.py N command [args...]
"""

import os
import subprocess
import sys

n = int(sys.argv[1])
procs = [subprocess.Popen(sys.argv[2:], env={**os.environ, "RANK": str(i), "WORLD_SIZE": str(n)}) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
