"""Reading the fleet's /metrics text in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with exactly ``labels`` (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def samples(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """Every family's type by name, and every sample's value by ``(name, sorted labels)``."""
    types: dict[str, str] = {}
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, out


def of_model(m: dict, name: str, model: str) -> float:
    """The one sample ``name`` labelled ``model_name=model`` in :func:`samples`' values."""
    got = [v for (n, ls), v in m.items() if n == name and dict(ls).get("model_name") == model]
    assert len(got) == 1, (name, model, got)
    return got[0]
