"""Checkpoints for exact resume: adapter (PEFT format) + optimizer, scheduler and RNG state.

Who calls it: the trainer every `save_steps` and on `resume_from_checkpoint`. A checkpoint is a
folder `checkpoint-N` in output_dir, written beside under a temporary name and renamed, so a
crash never leaves a half-written one that resume would pick. A missing or unreadable
checkpoint is a one-line `InvalidInputError`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from hetserve.errors import InvalidInputError
from hetserve.finetune.model import load_adapter_weights, save_adapter

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, step: int, model, optimizer, scheduler, log: list) -> Path:
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "log": log,
    }
    torch.save(state, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = [
        (int(p.name.split("-")[1]), p)
        for p in out_dir.glob("checkpoint-*")
        if p.name.split("-")[1].isdigit() and (p / STATE_FILE).is_file()
    ]
    return max(found)[1] if found else None


def resolve_resume(value, out_dir: Path) -> Path | None:
    """resume_from_checkpoint: a folder, or true for the latest in output_dir."""
    if value in (None, False):
        return None
    path = latest_checkpoint(out_dir) if value is True else Path(str(value))
    if path is None or not (path / STATE_FILE).is_file():
        where = out_dir if value is True else value
        raise InvalidInputError(f"resume_from_checkpoint: no checkpoint at {str(where)!r}")
    return path


def load_checkpoint(path: Path, model, optimizer, scheduler) -> tuple[int, list]:
    """Restores everything; returns (step done, log history)."""
    load_adapter_weights(model, path)
    try:
        state = torch.load(path / STATE_FILE, weights_only=False)
    except (OSError, RuntimeError) as exc:
        raise InvalidInputError(f"cannot read checkpoint {str(path)!r}: {exc}") from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["step"], state["log"]
