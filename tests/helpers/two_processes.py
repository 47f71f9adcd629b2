"""Launch a script on 2 CPU processes (gloo) for the multi-process trainer tests, without the `accelerate` CLI.

`accelerate launch --cpu --num_processes 2` starts a single process (accelerate's simple launcher); two CPU processes
need `--multi_gpu --num_processes 2` with `ACCELERATE_USE_CPU=true` (torchrun underneath, gloo backend). The launcher
runs as ``python -m accelerate.commands.launch`` from this interpreter, so nothing has to be on PATH and the tests
cannot skip.

The scripts import the shared test helpers by name (`tiny_configs`, `tiny_data`, `two_process_kit`): this folder is
on their ``PYTHONPATH``.

Scripts end with ``accelerator.wait_for_everyone()`` and ``os._exit(0)``: gloo's destructors race with the peer's exit
at interpreter teardown and can abort ("terminate called ...", SIGABRT) depending on timing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = str(Path(__file__).resolve().parent)

# A normal run takes 20-60 s on a loaded 2-core machine; the limit only turns a deadlock (a process left waiting in
# a collective) into a failure with the output, instead of a hung test session.
TIMEOUT_S = 300


def free_port() -> int:
    # not accelerate's default 29500: another multi-process test running at the same time would collide on it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_processes(
    tmp_path, script_text: str, *script_args: str, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Run `script_text` as ``script.py <tmp_path> <script_args...>`` on 2 CPU processes; fail the test on a
    timeout."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (HELPERS, os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(script),
        str(tmp_path),
        *script_args,
    ]
    # its own session: on a timeout the launcher and both workers are killed together, none is left behind
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"the 2-process run did not finish within {timeout:.0f} s (a process waiting in a collective the other "
            f"never entered?); stderr tail:\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def check_returncode(proc: subprocess.CompletedProcess) -> None:
    """Fail with the error lines and the stderr tail when the run failed."""
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "terminate" in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + proc.stderr[-3000:]
