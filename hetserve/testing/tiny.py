"""Tiny random checkpoints of the real architectures, written in the HF on-disk format (each
family's config in `tiny_families.py`).

Used by the tests (transformers loads the same files as the reference) and as the demo model.
Tensors are generated one at a time and written in shards, so multi-GB checkpoints for the
benchmarks need little memory. Weights are scaled by 1/sqrt(fan_in) so activations stay O(1).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from hetserve import envs
from hetserve.errors import InvalidInputError
from hetserve.model.config import ModelConfig
from hetserve.model.registry import model_class
from hetserve.model.st_file import save_safetensors
from hetserve.testing.chat_templates import FAMILY_FORMATS, FORMATS
from hetserve.testing.tiny_families import (
    DEMO_FAMILY,
    DEMO_OVERRIDES,
    KIMI_TOKENIZER,
    tiny_config,
)
from hetserve.testing.tiny_tiktoken import write_kimi_tokenizer
from hetserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN, write_tokenizer_files

SHARD_BYTES = 1 << 30


def cache_dir() -> Path:
    return envs.cache_dir()


def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, lm_scale: float):
    if name.endswith("A_log"):  # decays of a few percent per token: the state remembers
        return torch.log(0.02 + 0.1 * torch.rand(shape, generator=gen))
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    scale = lm_scale if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[-1]))


def _checkpoint_tensors(model, layout: str):
    """(checkpoint name, shape) in HF layout; routed experts per expert or fused."""
    custom = getattr(model, "hf_checkpoint_shapes", None)  # families with their own layout
    if custom is not None:
        yield from ((name, shape, None) for name, shape in custom())
        return
    names = model.expert_weight_names
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("w13", "w2"):
            e, two_i, h = p.shape if leaf == "w13" else (p.shape[0], 0, 0)
            if layout == "fused":
                fused = "gate_up_proj" if leaf == "w13" else "down_proj"
                yield model.published_name(f"{prefix}.{fused}"), tuple(p.shape), (leaf, None)
                continue
            for x in range(p.shape[0]):
                if leaf == "w13":
                    for half, n in ((0, names[0]), (1, names[1])):
                        yield f"{prefix}.{x}.{n}.weight", (two_i // 2, h), (leaf, (x, half))
                else:
                    yield f"{prefix}.{x}.{names[2]}.weight", tuple(p.shape[1:]), (leaf, (x, None))
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            yield model.published_name(name), tuple(p.shape), None


def make_tiny_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    overrides: dict | None = None,
    layout: str = "per-expert",
    lm_head_scale: float = 1.0,
    vocab_size: int = 512,
    progress: bool = False,
    dtype: str = "float32",
) -> Path:
    """Write config.json, *.safetensors, tokenizer files and generation_config.json to out_dir.
    `dtype` "bfloat16" halves the files (published-size shapes, e.g. the GPU benchmarks')."""
    if layout not in ("per-expert", "fused"):
        raise InvalidInputError(f"layout must be 'per-expert' or 'fused', got {layout!r}")
    if dtype not in _WRITE_DTYPES:
        raise InvalidInputError(f"dtype must be one of {sorted(_WRITE_DTYPES)}, got {dtype!r}")
    # The family and the sizes (the checks a loader and the model make), before anything is
    # written: a failure part way left a half-written directory that a rerun refused.
    planned = tiny_config(family, vocab_size, overrides)
    try:
        with torch.device("meta"):
            model_class(planned["architectures"][0])(ModelConfig.from_dict(planned))
    except ValueError as exc:
        if isinstance(exc, InvalidInputError):
            raise
        raise InvalidInputError(f"{family} with these sizes: {exc}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chat = FORMATS[FAMILY_FORMATS[family]]
    tok = write_tokenizer_files(out, cache_dir(), vocab_size, chat)
    cfg = tiny_config(family, tok.get_vocab_size(), overrides)
    eos_ids = [tok.token_to_id(t) for t in chat.eos or (EOS_TOKEN,)]
    bos_id = tok.token_to_id(chat.bos) if chat.bos else None
    cfg.update(
        eos_token_id=eos_ids[0], pad_token_id=tok.token_to_id(PAD_TOKEN), bos_token_id=bos_id
    )
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    with torch.device("meta"):
        model = model_class(cfg["architectures"][0])(ModelConfig.from_dict(cfg))
    gen = torch.Generator().manual_seed(seed)
    entries = list(_checkpoint_tensors(model, layout))
    centred = getattr(model, "zero_centred_norms", None)
    _write_shards(out, entries, gen, lm_head_scale, progress, _WRITE_DTYPES[dtype], centred)
    if family in KIMI_TOKENIZER:  # Kimi publishes a tiktoken-format tokenizer, no tokenizer.json
        write_kimi_tokenizer(out, cache_dir())
    return out


_WRITE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _write_shards(
    out: Path,
    entries,
    gen,
    lm_scale: float,
    progress: bool,
    dtype: torch.dtype = torch.float32,
    centred: re.Pattern | None = None,
) -> None:
    """`centred`: the names of norm weights the family stores zero-centred (the scale applied
    is 1 + w). Those are written as w = scale - 1, so every family's norms scale by about 1
    (published zero-centred weights sit near 0: Qwen3-Next puts weight decay on them); written
    as 1 + 0.1 randn they scaled by 2, and the doubled gains made the tiny Qwen3-Next 2-4x more
    sensitive to any perturbation (int8 rounding moved its prompt logprobs by 0.39 nats)."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(shape) * elem for _, shape, _ in entries)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for old in out.glob("*.safetensors"):
        old.unlink()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress)
    files, weight_map = [], {}
    for name, shape, _ in entries:
        t = _init_tensor(name, shape, gen, lm_scale)
        if centred is not None and centred.search(name):
            t = t - 1.0  # the same random draw: every other tensor stays as it was
        t = t.to(dtype).contiguous()
        if size and size + t.nbytes > SHARD_BYTES:
            files.append(_flush(out, shards[-1], len(files)))
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
        bar.update(t.nbytes)
    files.append(_flush(out, shards[-1], len(files)))
    bar.close()
    if len(files) == 1:
        os.replace(out / files[0][0], out / "model.safetensors")
        return
    n = len(files)
    for i, (fname, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / fname, out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _flush(out: Path, shard: dict, i: int) -> tuple[str, list[str]]:
    fname = f"shard-{i}.tmp.safetensors"
    save_safetensors(shard, str(out / fname), metadata={"format": "pt"})
    names = list(shard)
    shard.clear()
    return fname, names


def demo_model_dir() -> Path:
    """The embedded demo model (a Qwen3-MoE shape), built once under the cache directory."""
    path = cache_dir() / "demo-qwen3-moe-v2"
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(DEMO_FAMILY, tmp, overrides=DEMO_OVERRIDES, lm_head_scale=4.0)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
