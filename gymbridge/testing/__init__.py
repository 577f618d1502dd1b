"""Test doubles shared by the tests, launchers and benchmarks: a scripted model server, a fault
proxy, the TRL format warm-up. The library never imports this package.

The tiny offline models live in :mod:`gymbridge.models` (a product feature: ``smoke run``,
``--model tiny:FAMILY``); ``gymbridge.testing.tiny_vlm``, ``.tiny_omni`` and ``.families`` re-export
them for the tests. Nothing here downloads anything.
"""
