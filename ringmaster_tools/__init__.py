"""ringmaster's tooling: measurements and benchmarks that run beside the training path, never in it.

Nothing in ``ringmaster`` imports this package (tools/import_graph.py enforces it).
"""
