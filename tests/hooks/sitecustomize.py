"""Test hooks, loaded by every Python process whose PYTHONPATH holds this folder.

WRITE_LOG=path: log "RANK file" for each os.replace. All our outputs are written to a temporary
name and renamed into place, so this lists every output file write and the rank that made it.

KILL_AT_STEP=n (with KILL_RANK=r): the process of rank r SIGKILLs itself at its n-th optimizer
step, in the first attempt only (TORCHELASTIC_RESTART_COUNT 0): a worker dying mid-epoch.
"""
import os
import signal

if os.environ.get("WRITE_LOG"):
    _replace = os.replace

    def _logged_replace(src, dst, *args, **kwargs):
        with open(os.environ["WRITE_LOG"], "a") as log:
            log.write(f"{os.environ.get('RANK', '-')} {os.fspath(dst)}\n")
        return _replace(src, dst, *args, **kwargs)

    os.replace = _logged_replace

if (os.environ.get("KILL_AT_STEP") and os.environ.get("RANK") == os.environ.get("KILL_RANK", "1")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
    import torch

    _step, _count = torch.optim.SGD.step, [0]

    def _step_then_die(self, *args, **kwargs):
        _count[0] += 1
        if _count[0] == int(os.environ["KILL_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return _step(self, *args, **kwargs)

    torch.optim.SGD.step = _step_then_die
