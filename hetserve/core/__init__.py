"""The nouns of hetserve: small dataclasses; no I/O, no torch device APIs, nothing of ours."""

from hetserve.core.block_hash import BlockHash, hash_block_tokens
from hetserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from hetserve.core.sampling import SamplingParams

__all__ = [
    "BlockHash",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "hash_block_tokens",
]
