"""The configuration reference in docs/configuration.md is the one the config models generate."""

from __future__ import annotations

from serve_app.config import AppConfig
from tools.config_reference import DOC, reference, rows, with_reference


def test_the_doc_holds_the_reference_the_config_models_generate() -> None:
    current = DOC.read_text()
    assert current == with_reference(current), "docs/configuration.md is stale: run python -m tools.config_reference"


def test_every_field_of_every_config_model_has_a_row_with_a_description() -> None:
    table = list(rows(AppConfig))
    paths = {path for path, *_ in table}
    assert {
        "models[].engine_stall_timeout_s",
        "ingress.rate_limits.tokens_per_minute",
        "ingress.cors.max_age_s",
    } <= paths
    assert [path for path, _, _, description in table if not description] == []


def test_a_field_without_a_row_makes_the_reference_differ() -> None:
    """The staleness check can fail: a reference that lost a row is not the generated one."""
    generated = reference()
    doc = "intro\n" + generated + "\nafter\n"
    stale = doc.replace(next(line for line in generated.splitlines() if "max_n" in line) + "\n", "")
    assert stale != doc and with_reference(stale) == doc
