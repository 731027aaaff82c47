"""Cluster simulator: request traces replayed at datacenter scale through the Conductor's own
policy code (`hetserve.disagg.policy`, imported, never copied).

A discrete-event simulation of prefill and decode instances with a cost model passed in as data
(prefill time from new tokens and cached context, decode step time from batch and context,
per-tier transfer bandwidth and latency, per-node KV capacity), from published hardware presets
or a `hetserve profile` measured on a real machine. It answers what a policy, an admission rule
or a cluster size is worth on a trace (Mooncake's format or hetserve's own request logs) before
anyone buys the machines.

Who calls it: `hetserve sim`. Deterministic under a seed; a bad trace is one line naming the
line of the file at fault.
"""
