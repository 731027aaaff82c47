"""Cluster simulator: request traces replayed at datacenter scale through the Conductor's own
policy code (`hetserve.disagg.policy`, imported, never copied).

A discrete-event simulation of prefill and decode instances with a cost model passed in as data
(prefill time from new tokens and cached context, decode step time from batch and context,
per-tier transfer bandwidth and latency, per-node KV capacity), from published hardware presets
or a `hetserve profile` measured on a real machine. It answers what a policy, an admission rule
or a cluster size is worth on a trace (Mooncake's format or hetserve's own request logs) before
anyone buys the machines.

Modules, each with its own contract:
- `trace`: the trace and request-log format (reader, writer, block ids from token ids), shared
  with the load generator and the servers that log requests;
- `hardware`: instances as data (`Hardware`: a policy `InstanceProfile`, KV capacities, hand-off
  cost, price), published presets with their sources, profile files;
- `loop`: the event loop, the only thing with a clock; `prefill`, `decode`, `cache`: the
  instances and the caches it drives; `jobs`: a request's record;
- `metrics`, `run`, `search`, `options`, `plots`: what a run is worth, sweeps, the cheapest mix,
  option values, figures; `decisions`: decision logs and their replay.

Who calls it: `hetserve sim`, and the tests. Deterministic under a seed (the random policy's);
pure but for reading traces and profiles, writing logs and plots, and each run's own wall time.
A bad trace is one line naming the line of the file at fault.
"""
