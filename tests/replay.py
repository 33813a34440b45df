"""Replaying control-daemon command scripts, to compare the fake daemon with the real one.

The CI tier replays the commands recorded on an H100 (tests/data/h100/transcript.json)
against the fake and compares every reply, exit code and stderr. The GPU tier runs
:data:`SCRIPT` against the real daemon and the fake side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

RECORDING = Path(__file__).resolve().parent / "data" / "h100" / "transcript.json"
REPLAYED_STEPS = ("4.cmd", "4.restore", "4.start_server", "4.with_server", "4.batch_with_server")
NOT_FAKED = ("device_query",)  # hardware tables the fake does not imitate

#: A script for both daemons; {uid} and {server} are filled in as it runs.
SCRIPT = [
    "get_server_list",
    "get_default_active_thread_percentage",
    "set_default_active_thread_percentage 50",
    "set_default_active_thread_percentage 0",
    "set_default_active_thread_percentage abc",
    "set_default_device_pinned_mem_limit 0 4G",
    "get_default_device_pinned_mem_limit 0",
    "set_default_device_pinned_mem_limit 0 12Q",
    "get_default_device_pinned_mem_limit 0",
    "set_default_device_pinned_mem_limit 0 4G",
    "get_default_client_priority",
    "set_default_client_priority 1",
    "set_default_client_priority 0",
    "frobnicate",
    "get_server_status 999999",
    "get_client_list 999999",
    "terminate_client 999999 1",
    "ps",
    "get_device_client_list",
    "start_server -uid {uid}",
    "get_server_list",
    "get_server_status {server}",
    "get_client_list {server}",
    "get_active_thread_percentage {server}",
    "get_device_pinned_mem_limit {server} 0",
    "terminate_client {server} 999999",
    "ps",
    "get_device_client_list",
    "start_server -uid {uid}",
    "get_server_list\nget_default_active_thread_percentage",
]


def send(executable: str, pipe_dir: Path, text: str) -> tuple[str, str, int]:
    """One client-mode call, as a user would make it: stdout, stderr, exit code."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    result = subprocess.run(
        [executable], input=text + "\n", capture_output=True, text=True, env=env, timeout=30, check=False
    )
    return result.stdout, result.stderr, result.returncode


def run_script(executable: str, pipe_dir: Path) -> list[tuple[str, str, str, int]]:
    """Run :data:`SCRIPT`; pids in replies are replaced by <server> so two daemons compare.

    A new server's status is read once it has left INITIALIZING: how long that takes is the
    hardware's (the real one answered INITIALIZING in one run of four), not a difference between the daemons.
    """
    server = ""
    results = []
    for template in SCRIPT:
        command = template.format(uid=os.getuid(), server=server or 0)
        out, err, code = send(executable, pipe_dir, command)
        deadline = time.monotonic() + 30
        while template == "get_server_status {server}" and out.strip() == "INITIALIZING" and time.monotonic() < deadline:
            time.sleep(0.05)
            out, err, code = send(executable, pipe_dir, command)
        if command == "get_server_list" and out.strip():
            server = out.split()[0]
        if server:
            out, err = out.replace(server, "<server>"), err.replace(server, "<server>")
        results.append((template, out, err, code))
    return results


def recorded_records() -> tuple[dict, list[dict]]:
    data = json.loads(RECORDING.read_text())
    records = [
        r for r in data["records"]
        if r.get("step") in REPLAYED_STEPS and r.get("cmd") and not r["cmd"].startswith(NOT_FAKED)
        and r.get("rc") is not None
    ]
    return data["meta"], records
