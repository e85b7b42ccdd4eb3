"""What a rank of a real launch saw, for tests/test_cluster.py: copied into a folder put on the job's PYTHONPATH,
every Python process of the job imports it at start-up (``sitecustomize``), and each rank (a process with RANK and
LOCAL_RANK set) writes ``rank<RANK>.json`` beside this file: its environment, pid, interpreter and the ``ninja`` its
PATH finds.  It needs nothing of the job but PYTHONPATH, which DeepSpeed's launcher passes to every node itself.
"""

import json
import os
import shutil
import sys
from pathlib import Path

_path = Path(__file__).with_name(f"rank{os.environ.get('RANK')}.json")
if "RANK" in os.environ and "LOCAL_RANK" in os.environ and not _path.exists():  # the rank, not a child it starts
    _seen = {"pid": os.getpid(), "executable": sys.executable, "ninja": shutil.which("ninja"), "env": dict(os.environ)}
    _path.with_suffix(".tmp").write_text(json.dumps(_seen))
    _path.with_suffix(".tmp").replace(_path)
