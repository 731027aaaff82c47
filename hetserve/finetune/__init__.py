"""LoRA/DoRA fine-tuning (SFT) of hetserve's models with the routed experts on CPU backends.

Contract: `hetserve finetune CONFIG.yaml` (cli.py) or `trainer.run(config)` is the only entry
point; it reads LLaMA-Factory's SFT keys (config.py), trains the adapter and writes it in PEFT's
format (adapter_config.json + adapter_model.safetensors, the HF model's module names) with
trainer_log.jsonl, checkpoints and plots into output_dir. Every user mistake (config key or
value, dataset file or row, chat template, output folder) is an `InvalidInputError` raised
before the first step, so the CLI prints one line and exits 2; a failure during training leaves
the last checkpoint intact for `resume_from_checkpoint`.

What is ours and what is borrowed: PEFT makes the LoRA/DoRA layers and the adapter files,
torch gives AdamW and the LR schedulers, nltk and rouge-score the metrics. Ours are what they
cannot reach: the routed experts' backward through frozen fp32/int8/int4 weights on the CPU
(experts_grad.py and native/moe_backward.c: the inference backends have no autograd), the
stand-in KV cache that lets the inference model classes train (model.py), and the data formats'
edge cases with errors that name the file and row (data.py, template.py).

Layout: config.py and schedule.py are pure policy (no I/O, no clock); data.py, template.py,
model.py, experts_grad.py, trainer.py, checkpoint.py, evaluate.py and plot.py are services;
bench.py is `hetserve bench finetune`.
"""
