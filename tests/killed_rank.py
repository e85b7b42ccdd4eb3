"""A stand-in rank for the launcher's exit status (no torch): rank 1 SIGKILLs itself, rank 0 waits to be stopped."""

import os
import signal
import time

if os.environ.get("RANK") == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
