"""`training_loss.png` (and `training_eval_loss.png`) from the log history, as LLaMA-Factory's
`plot_loss` draws them: the raw loss and an exponentially smoothed curve over steps."""

from __future__ import annotations

from pathlib import Path


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    out, last = [], values[0] if values else 0.0
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out


def plot_loss(history: list[dict], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, name in (("loss", "training_loss.png"), ("eval_loss", "training_eval_loss.png")):
        points = [(h["current_steps"], h[key]) for h in history if key in h]
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
        if len(values) > 1:
            ax.plot(steps, smooth(list(values)), color="#1f77b4", label="smoothed")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{key} of {Path(out_dir).name}")
        ax.legend()
        path = Path(out_dir) / name
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
