"""A worker for the fork-server tests: ``python -m tests.workers.run.forked_probe CODE [SLEEP_S]`` prints what it
is (pid, parent, process group, command line, a variable of its environment), starts a grandchild ``sleep``, then
exits with ``CODE`` after ``SLEEP_S``."""

import json
import os
import subprocess
import sys
import time

if __name__ == "__main__":
    code, sleep_s = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    grandchild = subprocess.Popen(["sleep", "60"])
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        cmdline = [a.decode() for a in f.read().split(b"\0") if a]
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "cmdline": cmdline,
                      "argv": sys.argv, "probe_var": os.environ.get("PROBE_VAR"),
                      "stdin": sys.stdin.read(), "grandchild": grandchild.pid}), flush=True)
    time.sleep(sleep_s)
    sys.exit(code)
