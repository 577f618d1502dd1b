"""Test doubles and tiny offline models shared by the tests, launchers and benchmarks.

Nothing here downloads anything: every model is built from a small config with
random weights and a tokenizer trained in code.
"""
