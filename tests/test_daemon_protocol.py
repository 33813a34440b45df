"""Unit tests: parsing the control daemon's replies (texts as recorded on an H100)."""

import pytest

from mpsrun.daemon import ServerStatus, parse_pid_list, parse_ps, parse_server_status


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


def test_ps_rows_found_by_header():
    """ps rows are read by column name, with the command taking the rest of the line."""
    reply = "PID\tID\tSERVER\tDEVICE\tNAMESPACE\tCOMMAND\n10\t1\t-\t-\t4026531836\tnvidia-cuda-mps-server\n" \
            "11\t2\t10\tGPU-abc\t4026531836\tpython3 sim.py"
    rows = parse_ps(reply)
    assert [(r.pid, r.server_pid) for r in rows] == [(10, 0), (11, 10)]
    assert rows[1].device == "GPU-abc"
    assert parse_ps("") == [] and parse_ps("garbage") == []
