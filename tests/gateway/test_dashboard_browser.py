"""The live dashboard in a real headless Chromium (Debian's ``chromium``, driven by
Playwright) while load runs against a real ``tidegate serve`` with simulated workers.

The page must load without a console error, and what it renders must be the live numbers:
every number cell is recomputed here from the two snapshots the page itself fetched
(``data-from-at`` / ``data-to-at`` on <body>), the way Prometheus computes rate() and
histogram_quantile(); the snapshots hold what ``/metrics`` holds (checked between two
scrapes under load, and sample for sample once idle); and once the load has stopped, the
totals on the page are the totals of ``/metrics``.

Every wait is for an event (a poll rendered, a marker drawn), bounded by a generous
deadline. ``TIDEGATE_DASHBOARD_SCREENSHOT=path`` also saves a screenshot under load (the
one in docs/images/dashboard.png).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.gateway.test_dashboard import (
    ADMIN,
    ADMIN_KEY,
    USER_KEY,
    metric_samples,
    snapshot_samples,
    write_config,
)
from tests.loadthreads import ClosedLoop, Send
from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for

pytestmark = pytest.mark.e2e

ASSET_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DEADLINE_MS = DEADLINE_S * 2 * 1000  # the page's waits: a scale-up starts a process
STATUS_OF = {
    "completed": "200",
    "shed": "429",
    "rejected_full": "429",
    "rejected_deadline": "429",
    "rejected_holdback": "429",
    "rejected_unavailable": "503",
    "shutdown": "503",
    "expired": "504",
    "failed": "502",
    "cancelled": "499",
    "invalid": "4xx",
}
NOTHING = "\N{EN DASH}"  # what the page shows where nothing happened in the window
LOAD = {"high": 3, "medium": 2, "low": 3}  # embedding client threads per priority
CHAT_CLIENTS = 2  # streaming chat clients (high): the TTFT series
# Reads every number cell, the chart's last points and the markers in one go: the page
# re-renders between two separate reads.
READ_PAGE = """() => {
  const cells = {};
  for (const td of document.querySelectorAll("td[data-k]")) {
    const tr = td.closest("tr"), id = td.closest("table").id;
    const row = tr.dataset.replica || [tr.dataset.model, tr.dataset.priority].join("/");
    cells[[id, row, td.dataset.k].join("|")] = {value: td.dataset.value, text: td.textContent};
  }
  const points = {};
  for (const c of document.querySelectorAll("circle[data-series]")) {
    points[c.closest("figure > div").id + "|" + c.dataset.series] = c.dataset.value;
  }
  const markers = [...document.querySelectorAll("#chart-replicas .scale-event")]
    .map((g) => g.dataset.direction);
  return {from_at: document.body.dataset.fromAt, to_at: document.body.dataset.toAt,
          polls: Number(document.body.dataset.polls || 0), cells, points, markers,
          doctor: document.getElementById("doctor-findings").textContent,
          findings: document.querySelectorAll("#doctor-findings .finding").length};
}"""


def chromium() -> str:
    path = shutil.which("chromium")
    assert path is not None, (
        "Debian's chromium is not installed: run `make system-packages` (.ci/system-packages), "
        "or apt-get install -y --no-install-recommends chromium"
    )
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True)
        try:
            yield browser
        finally:
            browser.close()


# ---------------------------------------------------------------- the oracle (PromQL's)
def total(samples: list[Any], name: str, match: dict[str, str]) -> float | None:
    found = [v for n, labels, v in samples if n == name and match.items() <= labels.items()]
    return sum(found) if found else None


def increase(before: float | None, after: float | None) -> float | None:
    if after is None or before is None:
        return after
    return after - before if after >= before else after


def buckets(samples: list[Any], name: str, match: dict[str, str]) -> dict[float, float]:
    out: dict[float, float] = {}
    for n, labels, value in samples:
        if n == f"{name}_bucket" and match.items() <= labels.items():
            le = float(labels["le"])  # "+Inf" -> inf
            out[le] = out.get(le, 0.0) + value
    return out


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus' bucketQuantile (promql/quantile.go) over sorted (le, count) pairs."""
    if len(cumulative) < 2 or cumulative[-1][0] != math.inf or not cumulative[-1][1] > 0:
        return math.nan
    rank = q * cumulative[-1][1]
    b = next(i for i, (_, count) in enumerate(cumulative) if count >= rank)
    if b == len(cumulative) - 1:
        return cumulative[-2][0]
    if b == 0 and cumulative[0][0] <= 0:
        return cumulative[0][0]
    start, end, count = 0.0, cumulative[b][0], cumulative[b][1]
    if b > 0:
        start = cumulative[b - 1][0]
        count -= cumulative[b - 1][1]
        rank -= cumulative[b - 1][1]
    return start + (end - start) * rank / count


def expected_cells(base: dict[str, Any], cur: dict[str, Any]) -> dict[str, float | None]:
    """Every number the page shows for traffic, outcomes and CPU, from its two snapshots."""
    dt = cur["at"] - base["at"]
    s0, s1 = base["samples"], cur["samples"]
    out: dict[str, float | None] = {}
    for model in cur["models"]:
        for priority in cur["levels"]:
            row, name = {"model": model, "priority": priority}, f"{model}/{priority}"
            done = increase(
                total(s0, "tidegate_requests_total", row), total(s1, "tidegate_requests_total", row)
            )
            out[f"traffic-table|{name}|qps"] = (done or 0) / dt
            out[f"traffic-table|{name}|queue_depth"] = total(s1, "tidegate_queue_depth", row)
            for phase in ("ttft", "e2e"):
                match = {**row, "phase": phase}
                before = buckets(s0, "tidegate_request_duration_seconds", match)
                after = buckets(s1, "tidegate_request_duration_seconds", match)
                inc = [(le, increase(before.get(le), after[le]) or 0.0) for le in sorted(after)]
                for q in (0.5, 0.95, 0.99):
                    key = f"traffic-table|{name}|{phase}_p{round(q * 100)}"
                    # no such series (TTFT of embeddings): n/a; no request: NaN
                    out[key] = histogram_quantile(q, inc) if after else None
            rates: Counter[str] = Counter()
            totals: Counter[str] = Counter()
            for n, labels, value in s1:
                if n == "tidegate_requests_total" and row.items() <= labels.items():
                    status = STATUS_OF.get(labels["outcome"], "other")
                    rates[status] += (increase(total(s0, n, labels), value) or 0) / dt
                    totals[status] += value
            for status in ("200", "429", "503", "504", "502", "499", "4xx", "other"):
                out[f"outcome-table|{name}|rate:{status}"] = rates[status]
                out[f"outcome-table|{name}|total:{status}"] = totals[status]
    before_of = {r["id"]: r for r in base["replicas"]}
    for replica in cur["replicas"]:
        old = before_of.get(replica["id"])
        p1, p0 = replica["process"], old and old["process"]
        cpu = None
        if p1 and p0 and p1["cpu_seconds"] is not None and p0["cpu_seconds"] is not None:
            cpu = 100 * (increase(p0["cpu_seconds"], p1["cpu_seconds"]) or 0) / dt
        out[f"resource-table|{replica['id']}|cpu_pct"] = cpu
        rss = p1["rss_bytes"] / 2**20 if p1 and p1["rss_bytes"] is not None else None
        out[f"resource-table|{replica['id']}|rss_mib"] = rss
    return out


def assert_cell(cells: dict[str, Any], key: str, expected: float | None) -> None:
    cell = cells[key]
    if expected is None:
        assert (cell["value"], cell["text"]) == ("", "n/a"), key
    elif math.isnan(expected):
        assert (cell["value"], cell["text"]) == ("", NOTHING), key
    else:
        assert float(cell["value"]) == pytest.approx(expected, rel=1e-9, abs=1e-12), key
        assert cell["text"] not in ("n/a", NOTHING), key


# ------------------------------------------------------------------------- the scenario
def dashboard_load(url: str) -> ClosedLoop:
    """Client threads per priority, each sending one request after another until stopped,
    and streaming chat clients."""

    def embed(priority: str) -> Send:
        headers = {"Authorization": f"Bearer {USER_KEY}", "X-Priority": priority}

        def send(client: httpx.Client) -> httpx.Response:
            return client.post(
                f"{url}/v1/embeddings", json={"model": "sim", "input": "tide"}, headers=headers
            )

        return send

    def chat(client: httpx.Client) -> httpx.Response:
        headers = {"Authorization": f"Bearer {USER_KEY}"}
        payload = {
            "model": "chat",
            "messages": [{"role": "user", "content": "tide?"}],
            "max_tokens": 8,
            "stream": True,
        }
        with client.stream(
            "POST", f"{url}/v1/chat/completions", json=payload, headers=headers
        ) as answer:
            for _ in answer.iter_lines():
                pass
        return answer

    loops = [(p, embed(p)) for p, clients in LOAD.items() for _ in range(clients)]
    loops += [("chat", chat)] * CHAT_CLIENTS
    return ClosedLoop(loops, hang_fails=True)


def scaling_config(tmp_path: Path) -> Path:
    """One replica that scales to two under the load (and not back during the test), and a
    chat model of one replica."""
    return write_config(
        tmp_path,
        chat=True,
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_per_replica": 2,
            "interval_s": 0.5,
            "stable_window_s": 0,
            "scale_down": {"stabilization_window_s": 600},
        },
    )


def metrics(gateway: Proc) -> dict[Any, float]:
    return metric_samples(httpx.get(f"{gateway.url}/metrics", timeout=DEADLINE_S).text)


def idle(gateway: Proc) -> bool:
    described = httpx.get(f"{gateway.url}/admin/replicas", headers=ADMIN, timeout=DEADLINE_S)
    return all(
        model["queued"] == 0 and all(r["in_flight"] == 0 for r in model["replicas"])
        for model in described.json().values()
    )


@pytest.fixture(scope="module")
def page_script(browser: Any) -> Iterator[Any]:
    """A blank page running the dashboard's script (no server: its polls fail, quietly)."""
    page = browser.new_page()
    page.set_content('<span id="status"></span>')
    script = (resources.files("tidegate.gateway") / "dashboard_assets/dashboard.js").read_text()
    page.add_script_tag(content=script)
    yield page
    page.close()


def page_quantile(page: Any, q: float, cumulative: list[tuple[float, float]]) -> float:
    got = page.evaluate(
        "([q, b]) => window.tidegateDashboard.quantile(q, "
        "b.map(([le, c]) => [le === 'Infinity' ? Infinity : le, c]))",
        [q, [[le if le != math.inf else "Infinity", count] for le, count in cumulative]],
    )
    return math.nan if got is None else float(got)


INF = math.inf


@pytest.mark.parametrize(
    ("q", "cumulative", "expected"),
    [
        pytest.param(0.5, [(0.1, 10), (0.5, 20), (INF, 20)], 0.1, id="at-a-bound"),
        pytest.param(0.75, [(0.1, 10), (0.5, 20), (INF, 20)], 0.3, id="interpolated"),
        pytest.param(0.99, [(0.1, 10), (0.5, 20), (INF, 20)], 0.492, id="p99"),
        pytest.param(0.5, [(1, 4), (2, 4), (INF, 4)], 0.5, id="first-bucket-from-0"),
        pytest.param(0.5, [(0.1, 0), (0.5, 0), (INF, 5)], 0.5, id="all-in-inf"),
        pytest.param(0.5, [(0.1, 0), (INF, 0)], math.nan, id="nothing-observed"),
    ],
)
def test_quantile_is_prometheus_histogram_quantile(
    page_script: Any, q: float, cumulative: list[tuple[float, float]], expected: float
) -> None:
    """Prometheus' answers, worked by hand from promql/quantile.go, for the page and for the
    oracle this module checks the page with."""
    assert histogram_quantile(q, cumulative) == pytest.approx(expected, nan_ok=True)
    assert page_quantile(page_script, q, cumulative) == pytest.approx(expected, nan_ok=True)


@settings(max_examples=60, deadline=None)
@given(
    q=st.sampled_from([0.5, 0.9, 0.95, 0.99]),
    bounds=st.lists(st.floats(0.001, 100.0), min_size=1, max_size=8, unique=True),
    counts=st.lists(st.integers(0, 50), min_size=9, max_size=9),
)
def test_page_quantile_agrees_with_the_oracle_on_any_histogram(
    page_script: Any, q: float, bounds: list[float], counts: list[int]
) -> None:
    les = [*sorted(bounds), INF]
    cumulative = [(le, float(sum(counts[: i + 1]))) for i, le in enumerate(les)]
    expected = histogram_quantile(q, cumulative)
    assert page_quantile(page_script, q, cumulative) == pytest.approx(expected, nan_ok=True)


FINDING = {
    "rule": "rejection_storm",
    "severity": "critical",
    "model": "emb",
    "symptom": "emb: 120 of 400 requests answered 429 (2.0/s)",
    "numbers": {"refused": 120, "total": 400},
    "cause": "admission refuses a large share of what arrives",
    "fix": "raise queue.max_size or add replicas",
    "config_diff": "-    max_size: 10\n+    max_size: 100\n",
    "impact": 0.3,
}


OPENED_AT = 1_700_000_000.0  # the first poll's clock in the faked snapshots
SCALED_BEFORE = {  # a scale-up 30 s before the page was opened
    "at": OPENED_AT - 30.0,
    "model": "emb",
    "direction": "up",
    "reason": "target",
    "from": 1,
    "to": 2,
}


def fake_snapshot(at: float) -> dict[str, Any]:
    """What a gateway with one upstream that exports nothing, and one finding, answers; it
    scaled up 30 s before the page was opened."""
    return {
        "at": at,
        "poll_interval_s": 0.2,
        "window_s": 10.0,
        "history_s": 600.0,
        "levels": ["high"],
        "models": {"emb": {"task": "embeddings", "pools": ["default"]}},
        "samples": [],
        "replicas": [
            {
                "id": "emb-0",
                "model": "emb",
                "pool": "default",
                "kind": "upstream",
                "url": "http://10.0.0.5:8000",
                "state": "ready",
                "slots": 8,
                "in_flight": 0,
                "restarts": 0,
                "pid": None,
                "startup_s": None,
                "samples": None,
                "metrics_error": "/metrics unreachable",
                "process": None,
            }
        ],
        "scale_events": [SCALED_BEFORE],
        "doctor": {"available": True, "findings": [FINDING], "window_s": 60.0, "at": at},
    }


def test_page_shows_findings_and_what_a_replica_does_not_export(browser: Any) -> None:
    """The page over a gateway faked at the HTTP boundary: its own assets, a crafted
    snapshot per poll."""
    assets = resources.files("tidegate.gateway") / "dashboard_assets"
    polls = itertools.count()
    problems: list[str] = []

    def answer(route: Any) -> None:
        path = route.request.url.removeprefix("http://gateway.test")
        if path == "/dashboard/data":
            body = json.dumps(fake_snapshot(OPENED_AT + next(polls)))
            route.fulfill(body=body, content_type="application/json")
        elif path == "/dashboard":
            route.fulfill(body=(assets / "index.html").read_text(), content_type="text/html")
        else:
            name = path.removeprefix("/dashboard/assets/")
            route.fulfill(body=(assets / name).read_text(), content_type=ASSET_TYPES[name])

    page = browser.new_page()
    try:
        page.on("console", lambda m: m.type == "error" and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.route("http://gateway.test/**", answer)
        page.goto("http://gateway.test/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.polls) >= 2")
        finding = page.locator('.finding[data-severity="critical"][data-rule="rejection_storm"]')
        text = finding.inner_text()
        for part in ("(emb)", FINDING["symptom"], FINDING["cause"], FINDING["fix"], "refused 120"):
            assert part in text
        assert finding.locator("pre").inner_text() == FINDING["config_diff"]
        row = page.locator('#resource-table tr[data-replica="emb-0"]')
        cells = row.locator("td[data-k]").all_inner_texts()
        assert cells == ["n/a"] * 6
        assert row.locator("td").last.inner_text() == "/metrics unreachable"
        startup = page.locator('#startup-table tr[data-replica="emb-0"] td[data-k]')
        assert startup.all_inner_texts() == ["n/a"] * 4
        assert page.locator("#batch-charts").inner_text() == "emb: n/a (no batch metrics)"
        # A scale-up from before the page was opened is drawn: the axis reaches back to it.
        marker = page.locator('#chart-replicas .scale-event[data-direction="up"]')
        assert float(marker.get_attribute("data-at")) == SCALED_BEFORE["at"]
    finally:
        page.close()
    assert problems == []


def test_page_shows_the_live_numbers_of_metrics_under_load(browser: Any, tmp_path: Path) -> None:
    problems: list[str] = []
    with gateway_process("--config", str(scaling_config(tmp_path))) as gateway:
        context = browser.new_context(
            http_credentials={"username": "ops", "password": ADMIN_KEY},
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = context.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            fetched: list[Any] = []
            page.on("response", lambda r: r.url.endswith("/dashboard/data") and fetched.append(r))
            with dashboard_load(gateway.url) as load:
                opened = page.goto(f"{gateway.url}/dashboard")
                assert opened is not None
                assert opened.status == 200
                check_under_load(page, fetched, gateway, load)
            check_when_idle(page, fetched, gateway, load)
        finally:
            context.close()
    assert problems == []


# What the page shows of the scale-up, for the wait below and for its failure message.
SCALED = """() => ({
  markers: document.querySelectorAll(
    '#chart-replicas .scale-event[data-direction="up"]').length,
  ready: document.querySelectorAll('#replica-table td.state-ready').length,
  measured: document.querySelectorAll('#resource-table td[data-k="cpu_pct"]').length,
  polls: Number(document.body.dataset.polls || 0),
  status: document.getElementById("status").textContent,
})"""


def wait_until_scaled(page: Any, gateway: Proc, load: ClosedLoop) -> None:
    """The scale-up is marked, all three replicas are ready and measured, three polls drawn;
    a timeout says what the page showed and what the gateway says of its replicas."""
    condition = f"""() => {{ const s = ({SCALED})();
      return s.markers > 0 && s.ready == 3 && s.measured == 3 && s.polls >= 3; }}"""
    try:
        page.wait_for_function(condition, timeout=DEADLINE_MS)
    except Exception as error:
        shown = page.evaluate(SCALED)
        replicas = httpx.get(f"{gateway.url}/admin/replicas", headers=ADMIN, timeout=DEADLINE_S)
        raise AssertionError(
            f"the page never showed the scale-up: {shown}; load served {load.served()}, "
            f"statuses {dict(load.statuses)}, errors {load.errors[:3]}; "
            f"/admin/replicas: {replicas.text}"
        ) from error


def check_under_load(page: Any, fetched: list[Any], gateway: Proc, load: ClosedLoop) -> None:
    # The scale-up is marked, both replicas are measured, rates are on the page.
    wait_until_scaled(page, gateway, load)
    wait_for(lambda: load.served() > 100)
    if os.environ.get("TIDEGATE_DASHBOARD_SCREENSHOT"):
        wait_for_polls(page, 5)
        page.screenshot(path=os.environ["TIDEGATE_DASHBOARD_SCREENSHOT"], full_page=True)
    shown = page.evaluate(READ_PAGE)
    base, cur = page_snapshots(fetched, shown)
    expected = expected_cells(base, cur)
    for key, value in expected.items():
        assert_cell(shown["cells"], key, value)
    assert max(expected[f"traffic-table|sim/{p}|qps"] or 0 for p in LOAD) > 0
    # Streamed chat has a time to first token: a number on the page, not "n/a" nor "-".
    assert math.isfinite(expected["traffic-table|chat/high|ttft_p99"] or math.nan)
    assert "up" in shown["markers"]
    # Charts: their last points are the table's numbers of the same poll.
    for priority in LOAD:
        qps = shown["cells"][f"traffic-table|sim/{priority}|qps"]["value"]
        assert shown["points"][f"chart-qps|sim/{priority}"] == qps
    # No GPU here: its cells say so; CPU and memory come from each worker process.
    for replica in cur["replicas"]:
        assert shown["cells"][f"resource-table|{replica['id']}|gpu_util_pct"]["text"] == "n/a"
        assert float(shown["cells"][f"resource-table|{replica['id']}|rss_mib"]["value"]) > 0

    # A snapshot taken between two scrapes of /metrics: every counter and bucket in between.
    before = metrics(gateway)
    answer = httpx.get(f"{gateway.url}/dashboard/data", headers=ADMIN, timeout=DEADLINE_S)
    data = snapshot_samples(answer.json())
    after = metrics(gateway)
    monotone = [k for k in data if k[0].endswith(("_total", "_bucket", "_count"))]
    assert monotone
    for key in monotone:
        assert before.get(key, 0.0) <= data[key] <= after[key], key


def check_when_idle(page: Any, fetched: list[Any], gateway: Proc, load: ClosedLoop) -> None:
    """Load stopped, nothing queued or in flight: the page's totals are /metrics' totals."""
    wait_for(lambda: idle(gateway))
    wait_for_polls(page, 2)  # a poll that started after the last request ended
    shown = page.evaluate(READ_PAGE)
    now = metrics(gateway)
    totals: Counter[str] = Counter()
    for (name, labels), value in now.items():
        row = dict(labels)
        if name == "tidegate_requests_total":
            status = STATUS_OF.get(row["outcome"], "other")
            totals[f"outcome-table|{row['model']}/{row['priority']}|total:{status}"] += value
        elif name == "tidegate_queue_depth":
            key = f"traffic-table|{row['model']}/{row['priority']}|queue_depth"
            assert float(shown["cells"][key]["value"]) == value == 0
        elif name == "tidegate_cold_start_seconds_count":
            cell = shown["cells"][f"coldstart-table|{row['model']}/|cold_starts"]
            assert float(cell["value"]) == value >= 1
        elif name == "tidegate_replicas":
            series = f"{row['model']}/{row['pool']}/{row['state']}"
            assert float(shown["points"][f"chart-replicas|{series}"]) == value
    assert totals.total() >= load.served() > 100
    for key, value in totals.items():
        assert float(shown["cells"][key]["value"]) == value, key
    # Doctor: the findings of that poll, or the line that says there is no doctor.
    _, cur = page_snapshots(fetched, shown)
    if cur["doctor"]["available"]:
        assert shown["findings"] == len(cur["doctor"]["findings"])
    else:
        assert shown["doctor"] == cur["doctor"]["reason"] == "doctor not available"


def wait_for_polls(page: Any, more: int) -> None:
    polls = page.evaluate("() => Number(document.body.dataset.polls)")
    page.wait_for_function(
        "n => Number(document.body.dataset.polls) >= n", arg=polls + more, timeout=DEADLINE_MS
    )


def page_snapshots(fetched: list[Any], shown: dict[str, Any]) -> tuple[Any, Any]:
    """The two snapshots the page drew from, among those it fetched (newest first)."""
    wanted = (float(shown["from_at"]), float(shown["to_at"]))
    found: dict[float, Any] = {}
    for response in reversed(fetched):
        snapshot = response.json()
        if snapshot["at"] in wanted:
            found[snapshot["at"]] = snapshot
        if len(found) == len(set(wanted)):
            return found[wanted[0]], found[wanted[1]]
    raise AssertionError(f"the page drew from snapshots it did not fetch: {wanted}")
