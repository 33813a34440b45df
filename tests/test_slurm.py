"""A real Slurm job: sbatch + srun + mpsrun --per-node on the fake GPU (Slurm started by .ci/run).

.ci/run starts munged, slurmctld and slurmd on localhost (ci/slurm/start.sh) and sets
SLURM_CONF and MPSRUN_REQUIRE_SLURM=1; elsewhere this test is skipped when no cluster answers.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import FAKECUDA, cluster_answers

pytestmark = pytest.mark.slurm


@pytest.fixture
def slurm():
    if not cluster_answers():
        if os.environ.get("MPSRUN_REQUIRE_SLURM") == "1":
            pytest.fail("MPSRUN_REQUIRE_SLURM=1 but no Slurm cluster answers (see ci/slurm/start.sh)")
        pytest.skip("no Slurm cluster (ci/slurm/start.sh starts one)")


def test_sbatch_job_with_per_node_mpsrun(slurm, fake_gpu, short_tmp):
    """srun -n 4 mpsrun --per-node inside sbatch: the job exits 0, every rank is an MPS client of the node's
    one daemon with the right per-rank variables, and nothing is left on the node afterwards."""
    reports = short_tmp / "reports"
    reports.mkdir()
    script = short_tmp / "job.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\n"
        f"srun --overcommit -n 4 {sys.executable} -m mpsrun --per-node --mps on --thread-percentage auto "
        f"{sys.executable} {FAKECUDA} --report-dir {reports} --hold 1\n"
    )
    out = subprocess.run(["sbatch", "--wait", "--overcommit", "-n", "4", "-o", str(short_tmp / "job.out"), "--chdir", str(short_tmp),
                          str(script)], capture_output=True, text=True, timeout=300)
    log = (short_tmp / "job.out").read_text() if (short_tmp / "job.out").exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + log
    seen = {int(p.stem): json.loads(p.read_text()) for p in reports.glob("*.json")}
    assert sorted(seen) == [0, 1, 2, 3], log
    assert all(r["mps"] for r in seen.values()) and len({r["server"] for r in seen.values()}) == 1
    for rank, report in seen.items():
        env = report["env"]
        assert env["RANK"] == str(rank) and env["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[0]
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    assert not root.exists() or list(root.iterdir()) == []


def test_srun_per_node_failing_rank_stops_the_node(slurm, fake_gpu, short_tmp):
    """srun -n 3 mpsrun --per-node with rank 1 exiting 7: the node keeper stops the other ranks, srun exits 7 (every
    rank's mpsrun exits with the job's code), the summary names rank 1 once, and nothing is left on the node."""
    started = time.monotonic()
    out = subprocess.run(["srun", "--overcommit", "-n", "3", "--chdir", str(short_tmp), sys.executable, "-m", "mpsrun",
                          "--per-node", "--grace", "1", sys.executable, str(FAKECUDA), "--hold", "60", "--fail-rank",
                          "1", "--exit", "7"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 7, out.stderr
    assert out.stderr.count("exited with code 7 first") == 1 and "rank 1 (pid" in out.stderr, out.stderr
    assert time.monotonic() - started < 60
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    assert not root.exists() or list(root.iterdir()) == []
