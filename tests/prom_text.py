"""Reading Prometheus exposition text in tests: samples by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[Sample, float]:
    """Every sample of a scrape, keyed by its name and label set."""
    found: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name, frozenset(sample.labels.items())] = sample.value
    return found


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample (None: the scrape does not have it)."""
    return samples(text).get((name, frozenset(labels.items())))


def names(text: str) -> set[str]:
    """The sample names of a scrape (histograms as ``_bucket``, ``_count``, ``_sum``)."""
    return {name for name, _ in samples(text)}
