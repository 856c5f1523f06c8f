"""Test doubles: stand-ins the tests run in place of what production runs.

`sglang_server.py` is an SGLang server for CPUs (the built-in torch engine behind SGLang's HTTP
API); the SGLang launcher starts it, given `sglang_server.program(...)`, as `python -m tests.doubles.sglang_server`,
which resolves from the repository's root (`tests/conftest.py` puts the root on PYTHONPATH, so
that the servers the tests' Ray workers launch find it too). `reward_server.py` is a scoring endpoint
for `reward.type: Remote`, scripted to answer well or to misbehave, in a thread or a process.
"""
