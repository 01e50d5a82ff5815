"""Operations: what an on-call engineer reaches for.

``doctor`` (``tidegate doctor``) reads a running gateway, a Prometheus server or a simulator
report and prints ranked findings with config fixes; the rules themselves are pure and live
in ``tidegate.core.diagnose``. ``snapshot`` turns metric samples into doctor's input.
"""
