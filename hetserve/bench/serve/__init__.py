"""`hetserve bench serve`: an asyncio load generator for any OpenAI-compatible server.

workload.py holds the nouns (requests, workloads, fitting a context); datasets.py and trace.py
make workloads; client.py sends one request; runner.py schedules them; metrics.py and report.py
turn results into numbers, a table and plots; cli.py is the command.
"""
