"""The terminal progress bar draws in a terminal (a real pseudo-terminal here) and nowhere else."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

SCRIPT = """
import time
from dflash_assets.common.progress import StageProgressBar
with StageProgressBar("completions 0000000-0000099", 100) as bar:
    active = bar.active
    for done in (10, 50, 100):
        bar.update_to(done, tok_s=1234)
        time.sleep(0.05)
print("DONE", active, flush=True)
"""


def run_script(tty: bool, env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_PROGRESS_BAR"} | (env_extra or {})
    if not tty:
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column terminal
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(60) == 0
    os.close(controller)
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_a_bar_with_rate_eta_and_figures():
    text = run_script(tty=True)
    assert "completions 0000000-0000099" in text
    assert re.search(r"\| 50/100 \[", text), text  # absolute position, not increments
    assert re.search(r"100/100 \[\d\d:\d\d<00:00, +[\d.]+row/s, tok/s=1234\]", text), text
    assert "\r" in text  # redrawn in place


def test_pipes_and_logs_get_no_bar_and_the_switch_overrides():
    text = run_script(tty=False)
    assert text.strip() == "DONE False"
    assert "DONE True" in run_script(tty=False, env_extra={"DFLASH_PROGRESS_BAR": "1"})
    assert "DONE False" in run_script(tty=True, env_extra={"DFLASH_PROGRESS_BAR": "0"})
