"""Prometheus text read from a live process, and the series the dashboard reads."""

from __future__ import annotations

import json
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "keel-dashboard.json"


def dashboard_metrics() -> set[str]:
    """The series names the dashboard's queries read."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    names = {name for expr in exprs for name in re.findall(r"\bkeel_[a-z0-9_]+", expr)}
    assert len(names) >= 20, names
    return names


Samples = dict[str, list[tuple[dict[str, str], float]]]


async def scrape(url: str) -> Samples:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url)
    assert response.status_code == 200, response.text
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for found, value in samples.get(name, [])
        if all(found.get(k) == v for k, v in labels.items())
    )
