"""`do_predict` + `predict_with_generate`: greedy answers and BLEU-4 / ROUGE as LLaMA-Factory
reports them.

Who calls it: the trainer after training (or alone, with do_train false). It writes
`generated_predictions.jsonl` (one {"prompt", "predict", "label"} per example) and
`predict_results.json` (`predict_bleu-4`, `predict_rouge-1`, `predict_rouge-2`,
`predict_rouge-l`, each x100 and averaged over examples). Metrics come from the established
libraries: nltk's sentence BLEU over characters with smoothing method 3 (LLaMA-Factory's
choice) and Google's `rouge-score` over words (CJK characters count as words).

Generation runs the training model itself (LoRA active, no merge) under no_grad, recomputing
the whole sequence per new token: no KV cache, fine for evaluation sets of short answers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_WORDS = re.compile(r"[\u4e00-\u9fff\u3040-\u30ff\uac00-\ud7af]|[^\W_]+", re.UNICODE)


class _Words:
    """rouge-score tokenizer: words, and each CJK character on its own."""

    def tokenize(self, text: str) -> list[str]:
        return _WORDS.findall(text.lower())


def similarity(pred: str, label: str) -> dict[str, float]:
    from hetserve.finetune.model import require

    require("nltk"), require("rouge_score")
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_score import rouge_scorer

    scores = {}
    words_p, words_l = _Words().tokenize(pred), _Words().tokenize(label)
    if not words_p or not words_l:
        scores.update({"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0})
    else:
        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], tokenizer=_Words())
        r = scorer.score(label, pred)
        for ours, theirs in (("rouge-1", "rouge1"), ("rouge-2", "rouge2"), ("rouge-l", "rougeL")):
            scores[ours] = 100 * r[theirs].fmeasure
    if pred and label:
        bleu = sentence_bleu(
            [list(label)], list(pred), smoothing_function=SmoothingFunction().method3
        )
    else:
        bleu = 0.0
    scores["bleu-4"] = 100 * bleu
    return scores


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...]) -> list[int]:
    from hetserve.finetune.model import hidden_states

    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(max_new_tokens):
        x = torch.tensor(ids, dtype=torch.long, device=device)
        last = hidden_states(model, x, [len(ids)])[-1:]
        token = int(model.compute_logits(last)[0].argmax())
        if token in eos:
            break
        ids.append(token)
    return ids[len(prompt) :]


def predict(model, fmt, examples: list, max_new_tokens: int, out_dir: str | Path) -> dict:
    """Answers the last user turn of each example; writes the predictions and the metrics."""
    tok = fmt.tokenizer
    was_training = model.training
    model.eval()
    rows, totals = [], {}
    for ex in examples:
        prompt_ids = fmt.prompt_ids(ex)
        answer = tok.decode(greedy(model, prompt_ids, max_new_tokens, tok.eos_token_ids))
        label = ex.messages[-1]["content"]
        rows.append({"prompt": tok.decode(prompt_ids, False), "predict": answer, "label": label})
        for k, v in similarity(answer, label).items():
            totals[k] = totals.get(k, 0.0) + v
    model.train(was_training)
    out = Path(out_dir)
    with open(out / "generated_predictions.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    n = max(len(rows), 1)
    results = {f"predict_{k}": round(v / n, 4) for k, v in sorted(totals.items())}
    (out / "predict_results.json").write_text(json.dumps(results, indent=2))
    return results
