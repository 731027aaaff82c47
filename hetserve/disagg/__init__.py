"""Prefill/decode disaggregation and the Conductor: a KV-cache-centric cluster.

What lives here (each module states its own contract):
- roles and the KV hand-off: a prefill instance computes the prompt and the first token and
  hands the request's KV blocks to a decode instance (through the KV store by `BlockHash`, a
  direct push over `hetserve.transfer`, or Mooncake's Transfer Engine); a failed hand-off makes
  the decode instance recompute, so the request still completes;
- KV events in vLLM's format (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) that every
  instance publishes, and the global index the Conductor builds from them;
- the routing policy: a pure function, `decide(view, request, now) -> Decision`, over a
  `ClusterView` (per instance: role, hardware profile, queued prefill tokens, running decodes,
  free blocks; for the request, the longest cached prefix per instance and tier). No I/O and no
  clock of its own: the live Conductor and the simulator (`hetserve.sim`) call the same code;
- the Conductor service (`hetserve conductor`): an OpenAI-compatible front door that tokenizes,
  hashes blocks, consults the index, decides, and proxies the streams;
- cluster launchers (`hetserve cluster up`): local processes, later Ray, behind one interface.

Who calls it: the CLI front ends (`entrypoints/`) and the simulator. It uses the engine only
through its public API and the server over HTTP.
"""
