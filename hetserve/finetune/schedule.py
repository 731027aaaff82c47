"""Pure training policy: which examples make each optimizer step, the LR schedule, batching.

No I/O, no clock. The step plan is a function of (dataset size, config, seed) alone, so a
resumed run recomputes it and continues at step N with exactly the batches an uninterrupted
run would have used.
"""

from __future__ import annotations

import math

import torch

from hetserve.errors import InvalidInputError
from hetserve.finetune.config import FinetuneConfig
from hetserve.finetune.template import IGNORE


def split_eval(n: int, val_size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) example indices: val_size < 1 is a fraction, >= 1 a row count."""
    if val_size <= 0:
        return list(range(n)), []
    if val_size >= 1 and int(val_size) >= n:  # a count the rows cannot give (HF's split refuses)
        raise InvalidInputError(
            f"val_size {int(val_size)} leaves no rows to train on (the datasets have {n}); "
            "give fewer rows, or a fraction below 1"
        )
    k = int(val_size) if val_size >= 1 else max(1, round(n * val_size))
    k = min(k, n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[k:]), sorted(order[:k])


def step_plan(num_examples: int, cfg: FinetuneConfig) -> list[list[list[int]]]:
    """Per optimizer step, its micro-batches (lists of example positions). Each epoch shuffles
    with its own seed; a step never spans two epochs (the last one of an epoch may be short)."""
    bs, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    batches_per_epoch = math.ceil(num_examples / bs)
    steps_per_epoch = math.ceil(batches_per_epoch / accum)
    if cfg.max_steps > 0:
        total = cfg.max_steps
    else:
        total = max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))
    plan: list[list[list[int]]] = []
    epoch = 0
    while len(plan) < total:
        gen = torch.Generator().manual_seed(cfg.seed + epoch)
        order = torch.randperm(num_examples, generator=gen).tolist()
        batches = [order[i : i + bs] for i in range(0, num_examples, bs)]
        for i in range(0, len(batches), accum):
            plan.append(batches[i : i + accum])
            if len(plan) == total:
                break
        epoch += 1
    return plan


def warmup_steps(cfg: FinetuneConfig, total: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: FinetuneConfig, total: int):
    """torch's schedulers composed as HF Trainer's: linear warmup from ~0, then linear decay to
    0, cosine to 0, or constant."""
    from torch.optim import lr_scheduler as S

    warm = min(warmup_steps(cfg, total), total)
    rest = max(total - warm, 1)
    kind = cfg.lr_scheduler_type
    if kind == "linear":
        main = S.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=rest)
    elif kind == "cosine":
        main = S.CosineAnnealingLR(optimizer, T_max=rest, eta_min=0.0)
    else:  # constant, constant_with_warmup
        main = S.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warm == 0:
        return main
    ramp = S.LinearLR(optimizer, start_factor=1e-8, end_factor=1.0, total_iters=warm)
    return S.SequentialLR(optimizer, [ramp, main], milestones=[warm])


def collate(
    items: list[tuple[list[int], list[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Concatenated input ids [T], targets [T] (the next token's label, IGNORE at each
    sequence's last position) and the sequence lengths."""
    ids, targets, lengths = [], [], []
    for input_ids, labels in items:
        ids += input_ids
        targets += labels[1:] + [IGNORE]
        lengths.append(len(input_ids))
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(targets, dtype=torch.long, device=device),
        lengths,
    )
