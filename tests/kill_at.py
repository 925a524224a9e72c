"""`python tests/kill_at.py before|after MODULE.FUNCTION PATTERN SCRIPT [ARGS...]`: run SCRIPT, and SIGKILL this
process right before or after MODULE.FUNCTION is first called with arguments whose text matches PATTERN
(fnmatch): a real kill (no cleanup handler runs) at an exact point of a real run, on any machine speed."""

import fnmatch
import importlib
import os
import runpy
import signal
import sys

when, target, pattern, script, *args = sys.argv[1:]
module_name, name = target.rsplit(".", 1)
module = importlib.import_module(module_name)
real = getattr(module, name)


def killing(*call_args, **kwargs):
    hit = fnmatch.fnmatch(" ".join(map(str, call_args)), pattern)
    if hit and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*call_args, **kwargs)
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


setattr(module, name, killing)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
