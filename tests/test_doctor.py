"""mpsrun doctor: the verdict, the table and the JSON, on a machine without a driver and on the fake GPU."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "mpsrun", "doctor", *args], capture_output=True, text=True,
                          timeout=180)


def test_no_driver_is_said_plainly(no_gpu):
    """On a CPU-only machine doctor exits 3 and says there is no NVIDIA driver and no control program."""
    out = doctor()
    assert out.returncode == 3
    first = out.stdout.splitlines()[0]
    assert first.startswith("mpsrun doctor: MPS cannot be used here: no usable NVIDIA driver")
    assert "nvidia-cuda-mps-control is not on PATH" in first
    assert "driver         none" in out.stdout


def test_fake_gpu_is_reported_usable(fake_gpu, monkeypatch):
    """With a driver, a GPU and the control program, doctor exits 0 and lists the GPU and settings."""
    monkeypatch.setenv("MPSRUN_TMPDIR", str(fake_gpu.tmpdir))
    out = doctor()
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    assert lines[0] == "mpsrun doctor: MPS can be used here"
    assert any(line.startswith("GPU 0") and fake_gpu.uuids[0] in line and "compute mode Default" in line
               for line in lines)
    assert f"MPSRUN_TMPDIR={fake_gpu.tmpdir}" in out.stdout
    report = json.loads(doctor("--json").stdout)
    assert report["usable"] is True and report["gpus"][0]["uuid"] == fake_gpu.uuids[0]
    assert report["control_executable"].endswith("nvidia-cuda-mps-control")


@pytest.mark.parametrize(("field", "value", "message"), [("compute_mode", 2, "compute mode Prohibited"),
                                                         ("mig", 1, "MIG enabled")])
def test_unusable_gpu_is_explained(fake_gpu, field, value, message):
    """A GPU in Prohibited mode or with MIG on makes doctor exit 3 with the reason."""
    gpus = json.loads(Path(fake_gpu.nvml_dir, "gpus.json").read_text())
    gpus[0][field] = value
    Path(fake_gpu.nvml_dir, "gpus.json").write_text(json.dumps(gpus))
    out = doctor()
    assert out.returncode == 3
    assert "no visible GPU can run MPS" in out.stdout.splitlines()[0] and message in out.stdout


def test_our_own_daemon_is_recognised(fake_gpu):
    """Inside a running session, doctor lists the session's MPS processes as the mpsrun session's."""
    from mpsrun import mps_session

    with mps_session() as session:
        report = json.loads(doctor("--json").stdout)
        pids = {p["pid"]: p for p in report["mps_processes"]}
        # The fake daemon runs as a script named nvidia-cuda-mps-control, so its process name matches.
        entry = pids[session.daemons[0].pid]
        assert entry["mpsrun"] and entry["mine"] and entry["pipe_dir"] == str(session.daemons[0].pipe_dir)


@pytest.mark.parametrize(("case", "warned"), [("writable", False), ("not written", True), ("stale", True),
                                              ("compiled, doctor run with -O", False)])
def test_nvml_without_bytecode_is_warned_of(fake_gpu, monkeypatch, tmp_path, case, warned):
    """A pynvml whose bytecode is missing or older than its source, and cannot be written (PYTHONDONTWRITEBYTECODE),
    gets a warning naming the file and the compileall command; one whose bytecode the import writes, or that has it
    (also when doctor itself runs with -O, which reads other files), gets none."""
    import os
    import py_compile

    fake = Path(__file__).parent / "fake_nvml" / "pynvml.py"
    copy = tmp_path / "nvml" / "pynvml.py"
    copy.parent.mkdir()
    copy.write_text(fake.read_text())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(copy.parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    if case == "writable":
        monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    if case in ("stale", "compiled, doctor run with -O"):
        py_compile.compile(str(copy), doraise=True)
    if case == "stale":  # the source changed after it was compiled
        os.utime(copy, (time.time() + 60, time.time() + 60))
    flags = ["-O"] if case.endswith("-O") else []
    out = subprocess.run([sys.executable, *flags, "-m", "mpsrun", "doctor", "--json"], capture_output=True, text=True,
                         timeout=180)
    warnings = [w for w in json.loads(out.stdout)["warnings"] if "compiled bytecode" in w]
    if warned:
        assert len(warnings) == 1 and str(copy) in warnings[0] and "-m compileall" in warnings[0]
    else:
        assert warnings == []


def test_a_driver_whose_nvml_cannot_list_mps_clients_is_warned_of(fake_gpu, monkeypatch):
    """doctor says for each GPU whether this driver's NVML lists MPS clients (the per-rank memory comes from that
    list), and warns, in one line naming the GPU, where it cannot."""
    monkeypatch.setenv("MPSRUN_TMPDIR", str(fake_gpu.tmpdir))
    assert json.loads(doctor("--json").stdout)["gpus"][0]["nvml_lists_mps_clients"] is True
    monkeypatch.setenv("FAKE_NVML_NO_MPS_LIST", "1")
    out = doctor()
    assert out.returncode == 0
    assert "warning: GPU 0: this driver's NVML cannot list MPS clients" in out.stdout, out.stdout
    assert json.loads(doctor("--json").stdout)["gpus"][0]["nvml_lists_mps_clients"] is False


def test_what_the_machine_and_the_environment_say_is_printed_escaped(fake_gpu, monkeypatch):
    """A GPU name and an MPSRUN_* setting that hold escape sequences (OSC 52 writes the terminal's clipboard): doctor's
    table shows them escaped, never raw (it printed both as they were)."""
    fake_gpu.gpus[0]["name"] = "Fake\x1b]52;c;cHduZWQ=\x07"
    (fake_gpu.nvml_dir / "gpus.json").write_text(json.dumps(fake_gpu.gpus))
    monkeypatch.setenv("MPSRUN_ODD", "\x1b[2J\x9b")
    out = doctor()
    assert out.returncode == 0, out.stdout
    assert not any((ord(c) < 32 and c != "\n") or 0x7f <= ord(c) < 0xa0 for c in out.stdout), out.stdout
    assert "\\x1b]52;c;cHduZWQ=\\x07" in out.stdout and "MPSRUN_ODD=\\x1b[2J\\x9b" in out.stdout
