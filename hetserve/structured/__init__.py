"""Structured output: a request's `GrammarSpec` -> a token mask applied in the sampler.

Who calls it: `EngineCore` owns one `GrammarCompiler`. `RequestValidator` compiles a request's
grammar in the caller's thread (the server's event loop, never the engine thread) so that a
grammar that does not compile is refused before anything is queued; the compiled grammar is
cached by content, so `EngineCore.enqueue` finds it again and only copies a matcher per
sequence. `StepExecutor` starts `MaskJob`s (masks/) on a worker thread before each forward and
waits for them when the logits are there; the sampler applies them like any other logits
processor (`SamplingRow.disallowed`). The engine never sees what the grammar is.

The grammar engine is llguidance (measured against xgrammar on this machine: see
docs/structured-output.md and `hetserve bench grammar`).

Failure contract: a spec that does not compile raises `InvalidInputError` whose `param` is the
request field it came from. A token the matcher refuses (which the mask should have made
impossible) fails that request alone, as any per-request error in a step does.
"""

from hetserve.structured.compiler import GrammarCompiler, GrammarMatcher
from hetserve.structured.masks import MaskJob, start_masks

__all__ = ["GrammarCompiler", "GrammarMatcher", "MaskJob", "start_masks"]
