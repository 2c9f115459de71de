"""deploy/prometheus/alerts.yml: valid for promtool, each rule fires on its scripted
condition and not on a healthy series, names only series the code exports, and judges
the series a real run exports as it should."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

from jetfleet.services.gateway import Gateway
from nats.aio.client import Client as NatsClient

from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from tests.prom_text import samples
from tests.stack import InProcessStack
from tests.test_service_metrics import gateway, known_run

__all__ = ["gateway"]  # the fixture, imported for the real run

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
FAMILIES = {"CounterFamily": "", "GaugeFamily": "", "HistogramFamily": "histogram"}
NAME_RE = re.compile(r"\bjetfleet_[a-z0-9_]+")


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is needed (Debian's prometheus package); CI installs it"
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120)


def _alerts() -> list[str]:
    """The rules' alert names (promtool checks the file's structure)."""
    return re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.MULTILINE)


def _used_names() -> set[str]:
    """The metric names the rules' expressions read (comments left out)."""
    lines = [line.split("#", 1)[0] for line in RULES.read_text().splitlines()]
    return {name for line in lines if "runbook:" not in line for name in NAME_RE.findall(line)}


def exported_names() -> set[str]:
    """Every sample name a family declared in the code exports (a histogram's three)."""
    found: set[str] = set()
    for path in [*(ROOT / "jetfleet").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            kind = FAMILIES.get(node.func.id)
            first = node.args[0] if node.args else None
            if kind is None or not isinstance(first, ast.Constant):
                continue
            name = str(first.value)
            found |= {f"{name}{s}" for s in ("_bucket", "_count", "_sum")} if kind else {name}
    return found


def test_the_alert_rules_pass_promtool_check_rules() -> None:
    checked = _run("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in checked.stdout


def test_each_rule_fires_on_its_scripted_condition_and_not_on_a_healthy_series() -> None:
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == set(_alerts())
    result = _run("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_an_alert_names_is_one_the_code_exports() -> None:
    exported = exported_names()
    assert "jetfleet_worker_attempts_total" in exported  # the scan finds the families
    used = _used_names()
    assert used and used <= exported, used - exported


async def test_the_rules_judge_the_series_a_real_run_exports(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    gateway: Gateway,
    simulator: TargetSimulator,
    tmp_path: Path,
) -> None:
    # Every service scraped before and after a known run (2 commits, a 404 dead letter,
    # a rejection): 10 minutes of the first scrape, then 20 of the second, fed to the
    # rules as Prometheus would have scraped them.
    scrapes, _ = await known_run(settings, nc, stack, gateway, simulator)
    used = _used_names()
    series = []
    for service, text in scrapes.after.items():
        before = samples(scrapes.before[service])
        for (name, labels), after in samples(text).items():
            if name not in used:
                continue
            # A counter absent before the run had not counted yet: 0.
            first = before.get((name, labels), 0.0 if name.endswith("_total") else None)
            tags = dict(labels) | {"instance": service, "job": f"jetfleet-{service}"}
            body = ",".join(f'{k}="{v}"' for k, v in sorted(tags.items()))
            head = "_x10" if first is None else f"{first:g}x10"
            series.append({"series": f"{name}{{{body}}}", "values": f"{head} {after:g}x20"})
    assert any(s["series"].startswith("jetfleet_sink_dead_letters_total{") for s in series)
    quiet = [  # every rule but the one that fires
        "JetfleetWorkerSuccessRateLow",
        "JetfleetVersionCohortBehind",
        "JetfleetSecondOrderRetirements",
        "JetfleetConservationMismatch",
        "JetfleetRateLimiterFailingClosed",
        "JetfleetTargetHeldLong",
        "JetfleetTargetCircuitBrokenLong",
    ]
    fired = {
        "eval_time": "20m",
        "alertname": "JetfleetDeadLettersRising",
        "exp_alerts": [
            {
                "exp_labels": {"severity": "warning", "target": "demo"},
                "exp_annotations": {
                    "summary": "1 jobs of demo dead-lettered in 15 minutes",
                    "runbook": "docs/metrics.md#jetfleetdeadlettersrising",
                },
            }
        ],
    }
    assert sorted([*quiet, "JetfleetDeadLettersRising"]) == sorted(_alerts())
    cases = [fired] + [{"eval_time": "29m", "alertname": a, "exp_alerts": []} for a in quiet]
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}],
    }
    test_file = tmp_path / "real_run_test.yml"
    test_file.write_text(json.dumps(tests))  # YAML reads JSON
    result = _run("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr
