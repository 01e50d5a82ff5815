"""The fault suite (issue 11): real processes, real faults, an account of every request.

Here: an upstream answering 500s, an upstream killed mid-stream, a worker SIGKILLed under
load, an engine loop that dies under load, clients that leave mid-stream; each checks that
every request got exactly one HTTP answer and was counted once (``accounting``).
Beside it, in the suites of the part they break:
- SIGTERM with work longer than the grace: tests/gateway/test_shutdown.py;
- slow clients (headers, bodies, oversized bodies): tests/gateway/test_timeouts.py and
  tests/worker/test_server_limits.py;
- an engine loop that dies, in process and in a worker: tests/worker/test_engine_failure.py.
"""
