"""`hetserve bench soak`: a server under mixed, hostile load for a while, then checked whole.

cases.py says what is sent; client.py sends one attempt and judges the answer; probe.py reads
the server's /metrics; runner.py runs the clients and the sampler; report.py summarizes, prints
and plots; cli.py is the command.
"""
