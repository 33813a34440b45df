"""Unit tests: parsing the control daemon's replies (texts as recorded on an H100)."""

import pytest

from mpsrun.mps.replies import ServerStatus, parse_pid_list, parse_server_status


def test_pid_lists():
    """get_server_list/get_client_list print one PID a line; empty output means none."""
    assert parse_pid_list("") == []
    assert parse_pid_list("123\n456\n") == [123, 456]


def test_server_status():
    """The three documented states parse; anything else is a ValueError."""
    assert parse_server_status("ACTIVE\n") is ServerStatus.ACTIVE
    assert parse_server_status("INITIALIZING") is ServerStatus.INITIALIZING
    with pytest.raises(ValueError):
        parse_server_status("Server 999999 not found")


def test_log_diagnosis_from_recorded_h100_logs():
    """The client-limit refusal and the fatal-fault teardown, as the H100 logged them, are recognised."""
    from pathlib import Path

    from mpsrun.mps.replies import diagnose_log

    data = Path(__file__).parent / "data" / "h100"
    limit = (data.parent.parent.parent / "benchmarks" / "results" / "h100-scale64-control.log").read_text()
    assert diagnose_log(limit) == [
        "the MPS server refused clients: maximum number of clients (48) reached; use fewer ranks per GPU or more GPUs"
    ]
    fault = (data / "daemon_stdout.txt").read_text()
    assert diagnose_log(fault)[0].startswith("a client hit a fatal GPU error")
    assert diagnose_log("[2026-11-22 07:57:47.634 Control  8100] Starting control daemon") == []


def test_torn_down_clients_from_the_recorded_fault():
    """The clients torn down after the recorded H100 fault are read from the server log."""
    from pathlib import Path

    from mpsrun.mps.replies import torn_down_clients

    log = (Path(__file__).parent / "data" / "h100" / "daemon_stdout.txt").read_text()
    assert torn_down_clients(log) == [8315, 8336]
    assert torn_down_clients("nothing here") == []
