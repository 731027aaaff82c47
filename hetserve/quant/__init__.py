"""Weight formats in one place: how quantized matrices are stored, packed, laid out for the
native kernels, and how far their numbers may be from full precision.

Who imports it: `layers` (int8 linears), `moe` (the CPU expert backends), `model` (checkpoint
loaders, GGUF, `convert`) and `finetune`; it imports nothing of ours above `native`, `errors`
and `envs`, so every format is written once and every consumer reads the same bytes.

- `packed.py`: `QMatrix` (a matrix or a stack in one storage format, per-row parameters, so row
  and expert selection are indexing) and `PackedExperts` (one layer's routed experts in them).
- `quantize.py`: the quantizers hetserve applies itself (int8 per channel, int4 groups, FP8
  blocks, MXFP4) and the error bound each one promises.
- `layout.py`: byte orders the native kernels read (quads, tiles, gate/up pairs), and sizes off
  their units padded with zero weights up to them; values never change there.
- `checkpoint/`: what a published checkpoint's `quantization_config` means (FP8 block-scaled,
  MXFP4, GPTQ, compressed-tensors), tensor by tensor.
- `gguf.py`: GGUF block types read as the file stores them.
- `converted.py`: the file format `hetserve convert` writes.

Failure contract: a format a checkpoint names but hetserve cannot read is a `ModelLoadError`
naming it and the supported ones; shapes a format cannot hold are a `TensorShapeError`.
"""
