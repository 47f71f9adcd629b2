"""A simulated kill while a checkpoint is written, shared by the PPO and GRPO checkpoint tests.

Imported by module name: pytest puts this folder on `sys.path` when it collects the test files next to it.
"""

import os

import torch


def fail_torch_save_on(monkeypatch, name: str) -> None:
    """torch.save raises when it writes a file named `name` (a kill while that file is written)."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if os.path.basename(str(getattr(f, "name", f))) == name:
            raise OSError(f"killed while writing {name}")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
