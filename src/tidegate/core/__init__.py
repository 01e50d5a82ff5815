"""The functional core: every scheduling decision tidegate makes, and nothing else.

Invariants kept by every module here:

- standard library and ``tidegate.core`` imports only (a test enforces it);
- no clock reads, no I/O, no asyncio: time is always an argument (monotonic seconds);
- the same inputs give the same outputs.

The gateway, the worker, the controller and the simulator read the clock, call these
functions, execute what they return and record metrics.
"""
