#!/usr/bin/env python3
"""Record the real behaviour of nvidia-cuda-mps-control on a GPU machine.

Run once on the GPU test machine:  python3 tests/data/record_mps.py OUTDIR
Writes OUTDIR/transcript.json, OUTDIR/summary.txt, OUTDIR/daemon_stdout.txt
(and copies of any files in the MPS log directory under OUTDIR/logdir/).

Uses only the stdlib, psutil, pynvml and (in child processes) cupy.
Never uses a shell, never changes GPU settings, ends processes only by pid.
"""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback

import psutil
import pynvml

CTL = "nvidia-cuda-mps-control"

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "mps_out")
os.makedirs(OUT, exist_ok=True)

T_START = time.monotonic()
RECORDS = []
META = {}
CHILDREN = []          # client Popen objects
DAEMON = None          # Popen of the -f control daemon
WORK = tempfile.mkdtemp(prefix="mw", dir="/tmp")        # client output files
PIPE = tempfile.mkdtemp(prefix="mp", dir="/tmp")        # 0700
LOGD = tempfile.mkdtemp(prefix="ml", dir="/tmp")        # 0700
NOMPS = tempfile.mkdtemp(prefix="mn", dir="/tmp")       # empty pipe dir: no daemon
DAEMON_LOG = os.path.join(OUT, "daemon_stdout.txt")

BASE_ENV = dict(os.environ)
BASE_ENV["CUDA_MPS_PIPE_DIRECTORY"] = PIPE
BASE_ENV["CUDA_MPS_LOG_DIRECTORY"] = LOGD
BASE_ENV.pop("CUDA_VISIBLE_DEVICES", None)


def now_ms():
    return round((time.monotonic() - T_START) * 1000, 2)


def log(*a):
    print(f"[{now_ms():10.1f}]", *a, flush=True)


def rec(step, cmd=None, stdout=None, stderr=None, rc=None, elapsed_ms=None, **extra):
    r = {"step": step, "cmd": cmd, "stdout": stdout, "stderr": stderr, "rc": rc,
         "elapsed_ms": elapsed_ms, "t_ms": now_ms()}
    r.update(extra)
    RECORDS.append(r)
    short = (stdout or "").strip().replace("\n", "\\n")
    if len(short) > 160:
        short = short[:160] + "..."
    err = (stderr or "").strip().replace("\n", "\\n")[:160]
    extra_s = ""
    if extra:
        extra_s = " " + json.dumps(extra, default=str)[:400]
    log(f"{step} | {cmd!r} | rc={rc} | {elapsed_ms} ms | out={short!r} | err={err!r}{extra_s}")
    return r


def ctl_raw(stdin_text, timeout=20, args=None, env=None):
    t0 = time.monotonic()
    try:
        p = subprocess.run([CTL] + (args or []), input=stdin_text, capture_output=True,
                           text=True, timeout=timeout, env=env or BASE_ENV)
        return p.stdout, p.stderr, p.returncode, round((time.monotonic() - t0) * 1000, 2)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return out, err + "\n<TIMEOUT>", "timeout", round((time.monotonic() - t0) * 1000, 2)


def ctl(step, cmd, timeout=20, **extra):
    out, err, rc, ms = ctl_raw(cmd + "\n", timeout=timeout)
    return rec(step, cmd, out, err, rc, ms, **extra)


def list_dir(path):
    res = []
    try:
        for name in sorted(os.listdir(path)):
            st = os.lstat(os.path.join(path, name))
            m = st.st_mode
            typ = ("socket" if stat.S_ISSOCK(m) else "fifo" if stat.S_ISFIFO(m) else
                   "dir" if stat.S_ISDIR(m) else "symlink" if stat.S_ISLNK(m) else
                   "file" if stat.S_ISREG(m) else "other")
            res.append({"name": name, "mode": oct(stat.S_IMODE(m)), "type": typ,
                        "size": st.st_size, "uid": st.st_uid})
    except Exception as e:
        res.append({"error": repr(e)})
    return res


def proc_info(pid):
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"pid": pid, "name": p.name(), "cmdline": p.cmdline(), "ppid": p.ppid(),
                    "status": p.status(), "uids": list(p.uids()), "pgid": os.getpgid(pid),
                    "sid": os.getsid(pid), "exe": _safe(p.exe)}
    except Exception as e:
        return {"pid": pid, "error": repr(e)}


def _safe(f):
    try:
        return f()
    except Exception as e:
        return repr(e)


def step(name):
    """Decorator-free helper: run fn, catch everything."""
    def wrap(fn):
        log(f"===== {name} =====")
        try:
            fn()
        except Exception:
            tb = traceback.format_exc()
            rec(name, cmd="<exception>", stderr=tb)
        return fn
    return wrap


# ---------------------------------------------------------------- clients
CLIENT_SRC = r'''
import os, sys, time, json
mode, stopfile, maxs = sys.argv[1], sys.argv[2], float(sys.argv[3])
t0 = time.time()
import cupy as cp
src = r"""
extern "C" __global__ void spin(float* a, int n){
  int i = blockIdx.x*blockDim.x + threadIdx.x; float x = a[i];
  for (int k = 0; k < n; k++) { x = x*1.0000001f + 0.5f; }
  a[i] = x; }
extern "C" __global__ void bad(float* a){ *((volatile int*)0x10) = 1; }
"""
mod = cp.RawModule(code=src)
spin = mod.get_function("spin"); bad = mod.get_function("bad")
a = cp.zeros(8*256, dtype=cp.float32)
buf = cp.empty(64 << 20, dtype=cp.uint8)
spin((8,), (256,), (a, cp.int32(1000)))
cp.cuda.runtime.deviceSynchronize()
free, total = cp.cuda.runtime.memGetInfo()
print(json.dumps({"pid": os.getpid(), "free": free, "total": total,
                  "init_s": round(time.time()-t0, 3), "ready": True}), flush=True)
if mode == "fault":
    time.sleep(0.5)
    print("LAUNCHING_BAD", flush=True)
    bad((1,), (1,), (a,))
    cp.cuda.runtime.deviceSynchronize()
    print("FAULT_NOT_RAISED", flush=True)
    sys.exit(5)
if mode == "quick":
    sys.exit(0)
n = 0
while time.time() - t0 < maxs and not os.path.exists(stopfile):
    spin((8,), (256,), (a, cp.int32(20000)))
    cp.cuda.runtime.deviceSynchronize()
    n += 1
print(json.dumps({"done": True, "iters": n, "stopfile_seen": os.path.exists(stopfile)}), flush=True)
'''
CLIENT_PY = os.path.join(WORK, "client.py")
with open(CLIENT_PY, "w") as f:
    f.write(CLIENT_SRC)


class Client:
    n = 0

    def __init__(self, mode, maxs=60, env=None, tag=None):
        Client.n += 1
        self.tag = tag or f"c{Client.n}"
        self.stop = os.path.join(WORK, self.tag + ".stop")
        self.out = os.path.join(WORK, self.tag + ".out")
        self.err = os.path.join(WORK, self.tag + ".err")
        self.t0 = time.monotonic()
        with open(self.out, "w") as fo, open(self.err, "w") as fe:
            self.p = subprocess.Popen([sys.executable, CLIENT_PY, mode, self.stop, str(maxs)],
                                      stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                      env=env or BASE_ENV)
        self.pid = self.p.pid
        CHILDREN.append(self.p)
        log(f"client {self.tag} mode={mode} pid={self.pid}")

    def text(self):
        with open(self.out) as f:
            o = f.read()
        with open(self.err) as f:
            e = f.read()
        return o, e

    def ready(self):
        return '"ready": true' in self.text()[0]

    def wait_ready(self, timeout=60):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.ready():
                return round((time.monotonic() - self.t0) * 1000, 1)
            if self.p.poll() is not None:
                return None
            time.sleep(0.02)
        return None

    def finish(self, timeout=30, stop=True):
        if stop:
            open(self.stop, "w").close()
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = f"killed-after-timeout({self.p.wait(10)})"
        return rc

    def record(self, step_name, rc, **extra):
        o, e = self.text()
        return rec(step_name, cmd=f"client {self.tag} pid {self.pid}", stdout=o, stderr=e, rc=rc,
                   elapsed_ms=round((time.monotonic() - self.t0) * 1000, 1), **extra)


# ---------------------------------------------------------------- helpers
def nvml_procs():
    res = {}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for fname in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
                      "nvmlDeviceGetGraphicsRunningProcesses"):
            f = getattr(pynvml, fname, None)
            if f is None:
                res[fname] = "absent"
                continue
            try:
                lst = f(h)
                res[fname] = [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory,
                               "name": _safe(lambda: psutil.Process(p.pid).name()),
                               "cmd": _safe(lambda: " ".join(psutil.Process(p.pid).cmdline())[:120])}
                              for p in lst]
            except Exception as e:
                res[fname] = "error: " + repr(e)
    except Exception as e:
        res["error"] = repr(e)
    return res


def server_pids():
    out, _, rc, _ = ctl_raw("get_server_list\n")
    return [int(x) for x in out.split() if x.strip().isdigit()]


def daemon_log_size():
    try:
        return os.path.getsize(DAEMON_LOG)
    except OSError:
        return 0


def daemon_log_since(off):
    try:
        with open(DAEMON_LOG, "rb") as f:
            f.seek(off)
            return f.read().decode(errors="replace")
    except OSError as e:
        return repr(e)


STATE = {"uuid": None, "spid": None, "uid": os.getuid()}


# ---------------------------------------------------------------- steps
def s1_setup():
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    uuid = pynvml.nvmlDeviceGetUUID(h)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    STATE["uuid"] = uuid
    META.update({
        "uuid": uuid, "uid": os.getuid(),
        "driver_version": _safe(lambda: pynvml.nvmlSystemGetDriverVersion()),
        "cuda_driver_version": _safe(lambda: pynvml.nvmlSystemGetCudaDriverVersion()),
        "gpu_name": _safe(lambda: pynvml.nvmlDeviceGetName(h)),
        "compute_mode": _safe(lambda: pynvml.nvmlDeviceGetComputeMode(h)),
        "device_count": _safe(lambda: pynvml.nvmlDeviceGetCount()),
        "pynvml_version": _safe(lambda: __import__("importlib.metadata").metadata.version("nvidia-ml-py")),
        "pipe_dir": PIPE, "log_dir": LOGD, "nomps_dir": NOMPS, "work_dir": WORK,
        "ctl_path": shutil.which(CTL), "server_path": shutil.which("nvidia-cuda-mps-server"),
        "python": sys.version, "recorder_pid": os.getpid(),
    })
    rec("1.setup", data={"pipe": list_dir(PIPE), "pipe_mode": oct(stat.S_IMODE(os.stat(PIPE).st_mode)),
                         "log_mode": oct(stat.S_IMODE(os.stat(LOGD).st_mode))}, meta=dict(META))


def s1b_warmup():
    # warm CuPy's kernel cache with no daemon running (=> runs without MPS)
    c = Client("quick", env=BASE_ENV, tag="warmup")
    rc = c.finish(timeout=120, stop=False)
    c.record("1b.warmup_no_daemon_client", rc, nvml_after=nvml_procs())


def s2_help_nodaemon():
    out, err, rc, ms = ctl_raw("", args=["-h"])
    rec("2a.help", "-h", out, err, rc, ms)
    ctl("2b.no_daemon", "get_server_list")
    ctl("2b.no_daemon", "quit")


def s3_start_daemon():
    global DAEMON
    env = dict(BASE_ENV)
    env["CUDA_VISIBLE_DEVICES"] = STATE["uuid"]
    fo = open(DAEMON_LOG, "wb")
    t0 = time.monotonic()
    DAEMON = subprocess.Popen([CTL, "-f"], stdout=fo, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    fo.close()
    META["daemon_pid"] = DAEMON.pid
    tries = []
    first = None
    while time.monotonic() - t0 < 15:
        out, err, rc, ms = ctl_raw("get_server_list\n")
        tries.append({"t_ms": round((time.monotonic() - t0) * 1000, 2), "rc": rc,
                      "out": out, "err": err.strip()[:100]})
        if rc == 0:
            first = tries[-1]["t_ms"]
            break
        if DAEMON.poll() is not None:
            break
        time.sleep(0.005)
    rec("3.daemon_start", cmd="nvidia-cuda-mps-control -f", rc=DAEMON.poll(), elapsed_ms=first,
        data={"daemon_pid": DAEMON.pid, "polls": len(tries), "first_answer_ms": first,
              "distinct_failures": sorted({(t["rc"], t["err"]) for t in tries[:-1]}, key=str),
              "last": tries[-1] if tries else None,
              "pipe_dir": list_dir(PIPE), "log_dir": list_dir(LOGD),
              "daemon_proc": proc_info(DAEMON.pid),
              "daemon_children": [proc_info(c.pid) for c in _safe(lambda: psutil.Process(DAEMON.pid).children(True)) or []]})


def s4_commands():
    uuid, uid = STATE["uuid"], STATE["uid"]
    for cmd in ["get_server_list", "get_default_active_thread_percentage",
                "set_default_active_thread_percentage 50", "get_default_active_thread_percentage",
                "set_default_device_pinned_mem_limit 0 4G", "get_default_device_pinned_mem_limit 0",
                f"set_default_device_pinned_mem_limit {uuid} 2G",
                "get_default_device_pinned_mem_limit 0", f"get_default_device_pinned_mem_limit {uuid}",
                "get_default_client_priority", "set_default_client_priority 1",
                "get_default_client_priority",
                "set_default_client_priority 0", "set_default_active_thread_percentage 0",
                "set_default_active_thread_percentage 101", "set_default_active_thread_percentage abc",
                "set_default_device_pinned_mem_limit 0 12Q", "frobnicate", "get_server_status 999999",
                "get_client_list 999999", "terminate_client 999999 1", "ps", "get_device_client_list",
                "device_query"]:
        ctl("4.cmd", cmd)
    # restore sane defaults in case an "error" case was accepted
    ctl("4.restore", "set_default_active_thread_percentage 50")
    ctl("4.restore", "get_default_active_thread_percentage")
    ctl("4.restore", "get_default_device_pinned_mem_limit 0")
    # run 1 showed "12Q" is accepted as 12M, which made every client fail with
    # cudaErrorMemoryAllocation: set usable limits again (different values for the
    # ordinal and the UUID key, to learn which one a client gets: see its memGetInfo)
    ctl("4.restore", "set_default_device_pinned_mem_limit 0 4G")
    ctl("4.restore", f"set_default_device_pinned_mem_limit {uuid} 3G")
    ctl("4.restore", "get_default_device_pinned_mem_limit 0")
    ctl("4.restore", f"get_default_device_pinned_mem_limit {uuid}")
    # batching
    out, err, rc, ms = ctl_raw("get_server_list\nget_default_active_thread_percentage\n")
    rec("4.batch", "get_server_list\\nget_default_active_thread_percentage", out, err, rc, ms)
    out, err, rc, ms = ctl_raw("get_default_active_thread_percentage\nget_default_client_priority\n")
    rec("4.batch", "get_default_active_thread_percentage\\nget_default_client_priority", out, err, rc, ms)
    out, err, rc, ms = ctl_raw("get_default_active_thread_percentage")  # no trailing newline
    rec("4.no_newline", "get_default_active_thread_percentage<no newline>", out, err, rc, ms)

    # start_server and wait for a server pid
    t0 = time.monotonic()
    ctl("4.start_server", f"start_server -uid {uid}")
    seen = []
    spid = None
    while time.monotonic() - t0 < 10:
        out, err, rc, ms = ctl_raw("get_server_list\n")
        seen.append({"t_ms": round((time.monotonic() - t0) * 1000, 2), "cmd": "get_server_list",
                     "out": out, "rc": rc})
        pids = [int(x) for x in out.split() if x.isdigit()]
        if pids:
            spid = pids[0]
            break
        time.sleep(0.005)
    trigger = None
    if spid is None:
        # server did not appear by itself: start a client to trigger it
        trigger = Client("loop", maxs=30, tag="trigger")
        while time.monotonic() - t0 < 40:
            out, err, rc, ms = ctl_raw("get_server_list\n")
            seen.append({"t_ms": round((time.monotonic() - t0) * 1000, 2), "cmd": "get_server_list",
                         "out": out, "rc": rc, "after_trigger_client": True})
            pids = [int(x) for x in out.split() if x.isdigit()]
            if pids:
                spid = pids[0]
                break
            time.sleep(0.005)
    statuses = []
    if spid:
        while time.monotonic() - t0 < 40:
            out, err, rc, ms = ctl_raw(f"get_server_status {spid}\n")
            statuses.append({"t_ms": round((time.monotonic() - t0) * 1000, 2), "out": out, "rc": rc})
            if out.strip() == "ACTIVE":
                break
            time.sleep(0.005)
    STATE["spid"] = spid
    META["server_pid"] = spid
    rec("4.server_appear", cmd="poll get_server_list / get_server_status", stdout=str(spid),
        data={"server_list_polls": seen, "status_polls": statuses,
              "distinct_status_replies": sorted({s["out"] for s in statuses}),
              "needed_trigger_client": trigger is not None,
              "server_proc": proc_info(spid) if spid else None,
              "daemon_proc": proc_info(DAEMON.pid)})
    if trigger:
        rc = trigger.finish()
        trigger.record("4.trigger_client", rc)
    for cmd in ["get_server_list", f"get_server_status {spid}", f"get_client_list {spid}",
                f"get_active_thread_percentage {spid}", f"get_device_pinned_mem_limit {spid} 0",
                "get_device_client_list", f"get_device_client_list {spid}", "ps", f"ps -p {spid}",
                "device_query", f"device_query {spid}", f"start_server -uid {uid}",
                "get_server_list", f"get_client_list {spid}"]:
        ctl("4.with_server", cmd)
    out, err, rc, ms = ctl_raw("get_server_list\nget_default_active_thread_percentage\n")
    rec("4.batch_with_server", "get_server_list\\nget_default_active_thread_percentage", out, err, rc, ms)
    rec("4.pipe_dir_with_server", data={"pipe_dir": list_dir(PIPE), "log_dir": list_dir(LOGD)})


def wait_clients_listed(spid, pids, timeout=60, clients=()):
    t0 = time.monotonic()
    out = ""
    while time.monotonic() - t0 < timeout:
        if clients and any(c.p.poll() is not None for c in clients):
            return None, out + "<a client exited>"
        out, _, _, _ = ctl_raw(f"get_client_list {spid}\n")
        listed = {int(x) for x in out.split() if x.isdigit()}
        if set(pids) <= listed:
            return round((time.monotonic() - t0) * 1000, 1), out
        time.sleep(0.02)
    return None, out


def s5_clients():
    spid = STATE["spid"]
    c1 = Client("loop", maxs=60)
    c2 = Client("loop", maxs=60)
    r1, r2 = c1.wait_ready(), c2.wait_ready()
    ms, out = wait_clients_listed(spid, [c1.pid, c2.pid], clients=(c1, c2))
    META["client_pids_step5"] = [c1.pid, c2.pid]
    rec("5.clients_listed", cmd=f"get_client_list {spid} (poll)", stdout=out, elapsed_ms=ms,
        data={"ready_ms": [r1, r2], "client_pids": [c1.pid, c2.pid],
              "client_stdout": [c1.text()[0], c2.text()[0]]})
    for cmd in [f"get_client_list {spid}", "ps", f"ps -p {c1.pid}", f"ps -p {spid}",
                "get_device_client_list", f"get_device_client_list {spid}", "get_server_list"]:
        ctl("5.with_clients", cmd)
    rec("5.nvml_with_clients", data={"nvml": nvml_procs(), "server_pid": spid,
                                     "client_pids": [c1.pid, c2.pid],
                                     "server_proc": proc_info(spid),
                                     "client_proc": proc_info(c1.pid)})
    off = daemon_log_size()
    ctl("5.terminate", f"terminate_client {spid} {c1.pid}")
    rc1 = c1.finish(timeout=30, stop=False)
    c1.record("5.terminated_client", rc1, daemon_log=daemon_log_since(off))
    ctl("5.after_terminate", f"get_server_status {spid}")
    ctl("5.after_terminate", f"get_client_list {spid}")
    ctl("5.after_terminate", f"terminate_client {spid} {c1.pid}")  # already gone
    rc2 = c2.finish(timeout=30, stop=True)
    c2.record("5.client2_normal_exit", rc2)
    ctl("5.after_exit", f"get_client_list {spid}")
    ctl("5.after_exit", "ps")


def s6_nomps():
    spid = STATE["spid"]
    env = dict(BASE_ENV)
    env["CUDA_MPS_PIPE_DIRECTORY"] = NOMPS
    env["CUDA_MPS_LOG_DIRECTORY"] = NOMPS
    c = Client("loop", maxs=15, env=env, tag="nomps")
    r = c.wait_ready()
    time.sleep(0.5)
    rec("6.nomps_running", cmd="nvml while non-MPS client runs", elapsed_ms=r,
        data={"nvml": nvml_procs(), "client_pid": c.pid, "server_pid": spid,
              "client_stdout": c.text()[0]})
    ctl("6.nomps", f"get_client_list {spid}")
    ctl("6.nomps", "ps")
    ctl("6.nomps", "get_device_client_list")
    rec("6.nomps_pipe_dir", data={"nomps_dir": list_dir(NOMPS)})
    rc = c.finish(timeout=30, stop=True)
    c.record("6.nomps_exit", rc)


def s7_fault():
    spid = STATE["spid"]
    off = daemon_log_size()
    b = Client("loop", maxs=60, tag="faultB")
    b.wait_ready()
    a = Client("fault", maxs=60, tag="faultA")
    a.wait_ready()
    ms, out = wait_clients_listed(spid, [a.pid, b.pid], timeout=10)
    META["client_pids_fault"] = {"A": a.pid, "B": b.pid}
    rec("7.fault_clients_listed", cmd=f"get_client_list {spid}", stdout=out, elapsed_ms=ms)
    try:
        rca = a.p.wait(30)
    except subprocess.TimeoutExpired:
        rca = "still-running"
    a.record("7.faulting_client_A", rca)
    # give B a few seconds to be torn down (or not)
    try:
        rcb = b.p.wait(8)
    except subprocess.TimeoutExpired:
        rcb = None
    b_torn = rcb is not None
    if rcb is None:
        rcb = b.finish(timeout=30, stop=True)
    b.record("7.looping_client_B", rcb, torn_down_by_fault=b_torn)
    t0 = time.monotonic()
    polls = []
    while time.monotonic() - t0 < 5:
        o, e, rc, _ = ctl_raw(f"get_server_status {spid}\n")
        polls.append({"t_ms": round((time.monotonic() - t0) * 1000, 1), "out": o, "rc": rc})
        time.sleep(0.1)
    rec("7.status_after_fault", cmd=f"get_server_status {spid} (poll 5 s)",
        stdout=polls[-1]["out"] if polls else None,
        data={"distinct": sorted({p["out"] for p in polls}), "polls": polls})
    ctl("7.after_fault", "get_server_list")
    ctl("7.after_fault", f"get_client_list {spid}")
    ctl("7.after_fault", "ps")
    rec("7.daemon_log_fault", stdout=daemon_log_since(off))
    off2 = daemon_log_size()
    f = Client("quick", tag="fresh")
    rcf = f.finish(timeout=60, stop=False)
    f.record("7.fresh_client_after_fault", rcf, daemon_log=daemon_log_since(off2))
    ctl("7.after_fresh", "get_server_list")
    sp = server_pids()
    if sp:
        ctl("7.after_fresh", f"get_server_status {sp[0]}")
        if STATE["spid"] not in sp:
            META["server_pid_after_fault"] = sp[0]
            STATE["spid"] = sp[0]
    # second fault variant: fresh client verified under MPS while running
    g = Client("loop", maxs=20, tag="verify")
    g.wait_ready()
    ms, out = wait_clients_listed(STATE["spid"], [g.pid], timeout=10, clients=(g,))
    rec("7.verify_client_listed", cmd=f"get_client_list {STATE['spid']}", stdout=out, elapsed_ms=ms)
    rcg = g.finish(timeout=30, stop=True)
    g.record("7.verify_client_exit", rcg)


def s8_quit():
    spid = STATE["spid"]
    ctl("8.before_quit", f"get_client_list {spid}")
    srv = proc_info(spid) if spid else None
    off = daemon_log_size()
    t0 = time.monotonic()
    out, err, rc, ms = ctl_raw("quit\n", timeout=30)
    quit_ms = ms
    killed = None
    try:
        drc = DAEMON.wait(30)
    except subprocess.TimeoutExpired:
        killed = "SIGTERM"
        _safe(lambda: os.killpg(DAEMON.pid, signal.SIGTERM))
        try:
            drc = DAEMON.wait(5)
        except subprocess.TimeoutExpired:
            killed = "SIGKILL"
            _safe(lambda: os.killpg(DAEMON.pid, signal.SIGKILL))
            drc = DAEMON.wait(5)
    exit_ms = round((time.monotonic() - t0) * 1000, 1)
    time.sleep(0.3)
    rec("8.quit", "quit", out, err, rc, quit_ms,
        data={"daemon_exit_code": drc, "quit_to_daemon_exit_ms": exit_ms, "killed": killed,
              "server_before": srv, "server_after": proc_info(spid) if spid else None,
              "pipe_dir_after": list_dir(PIPE), "log_dir_after": list_dir(LOGD),
              "daemon_log_tail": daemon_log_since(off)})
    ctl("8.after_quit", "get_server_list")


def cleanup():
    log("===== cleanup =====")
    for p in CHILDREN:
        if p.poll() is None:
            log(f"killing leftover client pid {p.pid}")
            _safe(p.kill)
            _safe(lambda: p.wait(10))
    if DAEMON is not None and DAEMON.poll() is None:
        log(f"daemon pid {DAEMON.pid} still alive: SIGTERM to its group")
        _safe(lambda: os.killpg(DAEMON.pid, signal.SIGTERM))
        try:
            DAEMON.wait(5)
        except Exception:
            _safe(lambda: os.killpg(DAEMON.pid, signal.SIGKILL))
            _safe(lambda: DAEMON.wait(5))
        rec("cleanup.daemon", data={"daemon_rc": DAEMON.poll()})
    spid = STATE.get("spid")
    if spid:
        info = proc_info(spid)
        if "error" not in info and info.get("status") != "zombie" and "mps" in info.get("name", ""):
            log(f"server pid {spid} still alive: SIGTERM")
            _safe(lambda: os.kill(spid, signal.SIGTERM))
            rec("cleanup.server", data=info)


def s9_copy():
    dst = os.path.join(OUT, "logdir")
    names = os.listdir(LOGD)
    rec("9.logdir", data={"files": list_dir(LOGD)})
    if names:
        os.makedirs(dst, exist_ok=True)
        for n in names[:3]:
            _safe(lambda: shutil.copy(os.path.join(LOGD, n), os.path.join(dst, n)))


def write_outputs():
    with open(os.path.join(OUT, "transcript.json"), "w") as f:
        json.dump({"meta": META, "records": RECORDS}, f, indent=1, default=str)
    lines = ["MPS recording summary", "=" * 60]
    for k, v in META.items():
        lines.append(f"{k}: {v}")
    lines.append("=" * 60)
    for r in RECORDS:
        o = (r.get("stdout") or "").rstrip()
        e = (r.get("stderr") or "").rstrip()
        lines.append(f"[{r['step']}] cmd={r['cmd']!r} rc={r['rc']} ms={r['elapsed_ms']}")
        if o:
            lines.append("  stdout: " + o.replace("\n", "\n          ")[:3000])
        if e:
            lines.append("  stderr: " + e.replace("\n", "\n          ")[:3000])
        for k in r:
            if k not in ("step", "cmd", "stdout", "stderr", "rc", "elapsed_ms", "t_ms", "meta"):
                lines.append(f"  {k}: " + json.dumps(r[k], default=str)[:3000])
    with open(os.path.join(OUT, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    try:
        for name, fn in [("1.setup", s1_setup), ("1b.warmup", s1b_warmup),
                         ("2.help_nodaemon", s2_help_nodaemon), ("3.start_daemon", s3_start_daemon),
                         ("4.commands", s4_commands), ("5.clients", s5_clients),
                         ("6.nomps", s6_nomps), ("7.fault", s7_fault), ("8.quit", s8_quit)]:
            if name != "1.setup" and STATE["uuid"] is None:
                rec(name, cmd="<skipped: no uuid>")
                continue
            if name in ("5.clients", "6.nomps", "7.fault") and not STATE["spid"]:
                rec(name, cmd="<skipped: no server pid>")
                continue
            step(name)(fn)
            write_outputs()
    finally:
        try:
            cleanup()
        finally:
            _safe(s9_copy)
            rec("end", data={"total_s": round(time.monotonic() - T_START, 2)})
            write_outputs()
            log("done; outputs in", OUT)


if __name__ == "__main__":
    main()
