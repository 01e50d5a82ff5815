"""What ``tidegate profile`` was asked to do, checked once before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tidegate.core.capacity import Slo, StabilityRule
from tidegate.errors import ConfigError

DEFAULT_WINDOW_MS = 5.0  # the worker's default batch window, used by the batch sweep
MIN_WINDOW_S = 0.5  # shortest measurement window


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    out: Path
    model_path: str | None = None
    url: str | None = None  # measure this running server instead of starting workers
    through_gateway: bool = False  # measure inside `tidegate serve` (profile/gateway.py)
    serve_config: Path | None = None  # --through-gateway: the deployment's serve config
    # --through-gateway: the open-loop point's rate as a fraction of the closed-loop capacity
    # (profile/openloop.py); None: the default, 0: no open-loop point.
    open_loop: float | None = None
    engine: str = "transformers"
    sim_profile: str | None = None  # the simulated engine's profile.json
    task: str | None = None  # of a --model-path model that is not built in
    device: str = "cpu"
    slo: Slo = field(default_factory=Slo)
    workload: Path | None = None
    max_batch: int = 64
    max_concurrency: int = 64
    batch_windows_ms: tuple[float, ...] = (0.0, 2.0, 5.0, 10.0)
    min_seconds_per_point: float = 5.0
    max_seconds_per_point: float = 30.0
    max_duration_s: float | None = None
    max_output_tokens: int = 256
    seed: int = 0
    ready_timeout_s: float = 300.0
    command: str = ""  # the command line, for the report

    def __post_init__(self) -> None:
        if self.url is not None and self.model_path is not None:
            _bad("url", "--url and --model-path exclude each other", "give one of them")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            _bad("url", f"{self.url!r} is not an http(s) URL", "e.g. http://127.0.0.1:8000")
        if self.serve_config is not None and not self.through_gateway:
            _bad("config", "--config is the serve config of --through-gateway", "add it")
        if self.open_loop is not None and not self.through_gateway:
            _bad("open_loop", "--open-loop is a point of --through-gateway", "add it, or drop it")
        if self.open_loop is not None and not 0 <= self.open_loop <= 2:
            _bad("open_loop", f"{self.open_loop} is not a fraction of capacity", "e.g. 0.85")
        if self.through_gateway and self.url is not None and self.model_path is not None:
            _bad("model_path", "a running gateway at --url serves its own models", "drop it")
        if self.max_seconds_per_point < self.min_seconds_per_point:
            _bad(
                "max_seconds_per_point",
                "is below --min-seconds-per-point",
                "raise it to at least --min-seconds-per-point",
            )
        if any(w < 0 for w in self.batch_windows_ms) or not self.batch_windows_ms:
            _bad("batch_windows_ms", "needs one or more windows >= 0", "e.g. 0,2,5,10")
        if (
            self.engine == "simulated"
            and self.url is None
            and self.sim_profile is None
            and self.serve_config is None
        ):
            _bad(
                "sim_profile",
                "the simulated engine needs a profile to replay",
                "give --sim-profile PROFILE.json",
            )

    @property
    def local(self) -> bool:
        """True when the planner starts the workers itself."""
        return self.url is None

    def open_loop_fraction(self) -> float:
        """The open-loop point's rate over the closed-loop capacity; 0: none.

        Only where the planner starts the stack itself: with ``--url`` the gateway is shared
        with other traffic, and an open loop near its capacity is not the planner's to send.
        """
        from tidegate.profile.openloop import DEFAULT_FRACTION

        if not (self.through_gateway and self.local):
            return 0.0
        return DEFAULT_FRACTION if self.open_loop is None else self.open_loop

    def stability_rule(self) -> StabilityRule:
        return StabilityRule(
            num_windows=3,
            tolerance=0.10,
            min_seconds=self.min_seconds_per_point,
            max_seconds=self.max_seconds_per_point,
        )

    def window_s(self) -> float:
        """Three windows fill the minimum time of a point."""
        return max(MIN_WINDOW_S, self.min_seconds_per_point / 3)

    def batch_sizes(self) -> list[int]:
        return powers_of_two(self.max_batch)

    def concurrency_levels(self, most: int) -> list[int]:
        return powers_of_two(min(most, self.max_concurrency))


def powers_of_two(most: int) -> list[int]:
    """1, 2, 4 ... up to ``most``, and ``most`` itself when it is not a power of two."""
    values = [1]
    while values[-1] * 2 <= most:
        values.append(values[-1] * 2)
    if values[-1] < most:
        values.append(most)
    return values


def _bad(key: str, problem: str, fix: str) -> None:
    raise ConfigError("<command line>", key, problem, fix)
