"""The SFT loop: AdamW on the LoRA parameters, accumulation, clipping, logs, checkpoints.

Who calls it: `hetserve finetune` (entrypoints/finetune.py) and the tests, through `run(cfg)`.
All user mistakes (config, data, template, output folder) are raised as `InvalidInputError`s
before the first step; a failure during training leaves the last checkpoint as it was.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hetserve.errors import InvalidInputError
from hetserve.finetune.config import FinetuneConfig
from hetserve.finetune.schedule import IGNORE, collate, make_scheduler, split_eval, step_plan

log = logging.getLogger(__name__)
LOG_FILE = "trainer_log.jsonl"


@dataclass
class Prepared:
    model: torch.nn.Module
    fmt: object  # template.ChatFormat
    train: list  # encoded (ids, labels)
    eval: list
    eval_examples: list  # data.Example, for predictions
    device: torch.device


def pick_device(cfg: FinetuneConfig, say) -> tuple[str, str]:
    if torch.cuda.is_available():
        return "cuda", "bfloat16" if cfg.bf16 else "float32"
    if cfg.bf16:
        say("bf16: ignored on the CPU (fp32 is its compute type; bf16 matmuls are ~100x slower)")
    return "cpu", "float32"


def prepare(cfg: FinetuneConfig, say=print) -> Prepared:
    from hetserve.finetune.data import load_examples
    from hetserve.finetune.model import ExpertsPlacement, add_lora, load_for_training
    from hetserve.finetune.template import ChatFormat, encode_all
    from hetserve.model.tokenizer import Tokenizer

    fmt = ChatFormat(Tokenizer(cfg.model_name_or_path), cfg.template or "auto")
    examples = (
        load_examples(cfg.datasets(), cfg.dataset_dir, cfg.max_samples) if cfg.dataset else []
    )
    train_idx, eval_idx = split_eval(len(examples), cfg.val_size, cfg.seed)
    eval_examples = [examples[i] for i in eval_idx]
    if cfg.eval_dataset:
        eval_examples = load_examples(
            cfg.datasets("eval_dataset"), cfg.dataset_dir, cfg.max_samples
        )
    train, dropped = encode_all(fmt, [examples[i] for i in train_idx], cfg.cutoff_len)
    if dropped:
        say(f"dropped {dropped} example(s) left with no answer tokens within cutoff_len")
    if cfg.do_train and not train:
        raise InvalidInputError("no training example has answer tokens within cutoff_len")
    evals, _ = encode_all(fmt, eval_examples, cfg.cutoff_len)
    device, dtype = pick_device(cfg, say)
    placement = ExpertsPlacement(
        on_cpu=cfg.use_kt, rules_path=cfg.kt_optimize_rule, bits=cfg.quantization_bit or 32,
        cpu_threads=cfg.cpu_infer, chunk_size=cfg.chunk_size,
    )  # fmt: skip
    model = load_for_training(cfg.model_name_or_path, device, dtype, placement)
    if cfg.adapter_name_or_path:
        _add_saved_adapter(model, cfg)
    else:
        add_lora(model, cfg.targets, cfg.lora_rank, cfg.alpha, cfg.lora_dropout, cfg.use_dora,
                 str(cfg.model_name_or_path))  # fmt: skip
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    return Prepared(model, fmt, train, evals, eval_examples, torch.device(device))


def _add_saved_adapter(model, cfg: FinetuneConfig) -> None:
    """LoRA layers shaped as a saved adapter says (its rank, alpha, targets, DoRA), then its
    weights; training continues from there (lora_dropout still from the config)."""
    from hetserve.finetune.model import ADAPTER_CONFIG, add_lora, load_adapter_weights

    path = Path(cfg.adapter_name_or_path) / ADAPTER_CONFIG
    if not path.is_file():
        raise InvalidInputError(
            f"adapter_name_or_path: no {ADAPTER_CONFIG} in {str(path.parent)!r}"
        )
    saved = json.loads(path.read_text())
    targets, dora = sorted(saved["target_modules"]), bool(saved.get("use_dora"))
    add_lora(model, targets, saved["r"], saved["lora_alpha"], cfg.lora_dropout, dora,
             str(cfg.model_name_or_path))  # fmt: skip
    load_adapter_weights(model, cfg.adapter_name_or_path)


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations. The
    layer's `forward` is wrapped in place, so module names (and the adapter's) are unchanged."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.model.layers:
        inner = layer.forward

        def forward(x, ctx, inner=inner):
            return checkpoint(inner, x, ctx, use_reentrant=False)

        layer.forward = forward


def loss_sum(model, items, device) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the label tokens of `items`, and their count."""
    from hetserve.finetune.model import hidden_states

    ids, targets, lengths = collate(items, device)
    hidden = hidden_states(model, ids, lengths)
    keep = targets != IGNORE
    # Only labelled positions reach the LM head: the prompt's logits are never needed.
    logits = model.compute_logits(hidden[keep])
    return F.cross_entropy(logits, targets[keep], reduction="sum"), int(keep.sum())


def eval_loss(model, items, batch_size: int, device) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(items), batch_size):
            s, n = loss_sum(model, items[i : i + batch_size], device)
            total, count = total + float(s), count + n
    model.train()
    return total / max(count, 1)


def out_dir_for(cfg: FinetuneConfig) -> Path:
    out = Path(cfg.output_dir)
    busy = out.is_dir() and any(out.iterdir())
    if busy and cfg.do_train and not cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
        raise InvalidInputError(
            f"output_dir {str(out)!r} is not empty; set overwrite_output_dir: true "
            "or resume_from_checkpoint"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


class _Logger:
    def __init__(self, out: Path, total: int, history: list) -> None:
        self.out, self.total, self.history = out, total, history
        self.start = time.perf_counter()
        (out / LOG_FILE).write_text("".join(json.dumps(h) + "\n" for h in history))

    def write(self, entry: dict) -> None:
        self.history.append(entry)
        with open(self.out / LOG_FILE, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def train(self, step: int, loss: float, lr: float, epoch: float, tokens_s: float, done0: int):
        elapsed = time.perf_counter() - self.start
        rate = (step - done0) / elapsed if elapsed > 0 else 0.0
        remaining = (self.total - step) / rate if rate > 0 else 0.0
        self.write({
            "current_steps": step, "total_steps": self.total, "loss": round(loss, 6),
            "lr": lr, "epoch": round(epoch, 4), "percentage": round(100 * step / self.total, 2),
            "elapsed_time": _hms(elapsed), "remaining_time": _hms(remaining),
            "throughput": round(tokens_s, 1),
        })  # fmt: skip


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def run(cfg: FinetuneConfig, say=print) -> dict:
    """Train (and evaluate/predict) as the config says; returns the final metrics."""
    out = out_dir_for(cfg)
    torch.manual_seed(cfg.seed)
    p = prepare(cfg, say)
    results: dict = {}
    if cfg.do_train:
        results.update(train(cfg, p, out, say))
    if cfg.evaluates and p.eval:
        results["eval_loss"] = eval_loss(p.model, p.eval, cfg.per_device_eval_batch_size, p.device)
    if cfg.do_predict:
        from hetserve.finetune.evaluate import predict

        results.update(predict(p.model, p.fmt, p.eval_examples, cfg.max_new_tokens, out))
    (out / "all_results.json").write_text(json.dumps(results, indent=2))
    return results


def train(cfg: FinetuneConfig, p: Prepared, out: Path, say) -> dict:
    from hetserve.finetune.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        resolve_resume,
        save_checkpoint,
    )
    from hetserve.finetune.model import lora_parameters, save_adapter

    model, params = p.model, lora_parameters(p.model)
    plan = step_plan(len(p.train), cfg)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay,
    )  # fmt: skip
    scheduler = make_scheduler(optimizer, cfg, len(plan))
    done, history = 0, []
    resume = resolve_resume(cfg.resume_from_checkpoint, out)
    if resume is not None:
        done, history = load_checkpoint(resume, model, optimizer, scheduler)
        say(f"resumed from {resume} at step {done}")
    logger = _Logger(out, len(plan), history)
    model.train()
    loop = _Loop(cfg, p, plan, optimizer, scheduler, params, logger)
    try:
        for step in loop.steps(done):
            if step % cfg.save_steps == 0 and step < len(plan):
                save_checkpoint(out, step, model, optimizer, scheduler, logger.history)
    except KeyboardInterrupt:  # what is kept, and how to go on from it
        last = latest_checkpoint(out)
        say("stopped; " + (f"the latest checkpoint is {last}: add resume_from_checkpoint: true "
                           "to the config to go on from it" if last is not None else
                           f"no checkpoint yet (one every save_steps = {cfg.save_steps} steps)"))
        raise
    save_adapter(model, out)
    if cfg.plot_loss:
        from hetserve.finetune.plot import plot_loss

        plot_loss(logger.history, out)
    results = {"train_loss": loop.mean_loss, "train_tokens_per_second": loop.tokens_per_second}
    (out / "train_results.json").write_text(json.dumps(results, indent=2))
    return results


class _Loop:
    """The optimizer steps, with the progress bar, logging and evaluation between them."""

    def __init__(self, cfg, p, plan, optimizer, scheduler, params, logger) -> None:
        self.cfg, self.p, self.plan = cfg, p, plan
        self.optimizer, self.scheduler = optimizer, scheduler
        self.params, self.logger = params, logger
        self.losses: list[float] = []
        self.tokens, self.seconds = 0, 0.0

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / max(len(self.losses), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def one_step(self, micro_batches: list[list[int]]) -> tuple[float, int]:
        items = [[self.p.train[i] for i in mb] for mb in micro_batches]
        n_labels = sum(sum(t != IGNORE for t in lab[1:]) for mb in items for _, lab in mb)
        self.optimizer.zero_grad(set_to_none=True)
        total, tokens = 0.0, 0
        for mb in items:
            s, _ = loss_sum(self.p.model, mb, self.p.device)
            # Normalised by the whole step's label count: accumulation equals one big batch.
            (s / n_labels).backward()
            total += float(s.detach())
            tokens += sum(len(ids) for ids, _ in mb)
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return total / n_labels, tokens

    def steps(self, done: int):
        from tqdm import tqdm

        cfg, total = self.cfg, len(self.plan)
        window: list[float] = []
        bar = tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True)
        for step in range(done + 1, total + 1):
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            loss, tokens = self.one_step(self.plan[step - 1])
            self.seconds += time.perf_counter() - t0
            self.tokens += tokens
            self.losses.append(loss)
            window.append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self.tokens_per_second:.0f}")
            if step % cfg.logging_steps == 0 or step == total:
                epoch = step / self._steps_per_epoch()
                mean = sum(window) / len(window)
                self.logger.train(step, mean, lr, epoch, self.tokens_per_second, done)
                window = []
            if cfg.evaluates and cfg.eval_steps and step % cfg.eval_steps == 0 and self.p.eval:
                value = eval_loss(self.p.model, self.p.eval, cfg.per_device_eval_batch_size,
                                  self.p.device)  # fmt: skip
                self.logger.write({"current_steps": step, "total_steps": total, "eval_loss": value})
            yield step
        bar.close()

    def _steps_per_epoch(self) -> int:
        cfg = self.cfg
        batches = -(-len(self.p.train) // cfg.per_device_train_batch_size)
        return max(1, -(-batches // cfg.gradient_accumulation_steps))
